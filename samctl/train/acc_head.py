"""Train a SpecDec++ acceptance head for one target/draft pair (Huang, Guo & Wang 2024).

    samctl train acc-head --target samctl/models/default/target \
        --draft samctl/models/default/draft --prompts ../shared/data/codealpaca.json \
        --num-prompts 300 --out samctl/models/default/acc_head

1. Prompts: the first user turn of every record of --prompts (any input `samctl build` reads: a
   folder, Alpaca / GSM8K / Spec-Bench JSON(L), Parquet, hf:NAME), shuffled with --seed, the
   first --num-prompts taken; --heldout of them are kept apart for the reported held-out loss and
   a tenth of the rest validates (the head keeps the weights of its best pass on them); the chat
   template is applied when the tokenizer has one (--no-chat to skip).
2. Responses: the target writes up to --max-new-tokens per prompt, sampled at
   --response-temperature (0 = greedy, no top-k/top-p) with --seed, cut after EOS, by the one
   answer writer (samctl/train/answers.py: the batched engine, --response-batch rows at once, its
   sampling lossless, so the answers follow the target's own distribution). With --cache they are
   kept in a JSONL file there, named by model, prompts and settings, and a rerun reuses them.
3. Examples (`decode.acceptance_head.collect_examples`): teacher-forced on each response, the
   draft samples a token per position at temperature 1, labelled min(1, p/q) (the paper's labels;
   --label-mode greedy instead drafts the argmax, labelled 1 when it is the target's argmax, for
   heads meant for greedy decoding); --mixing-ratio of
   the positions are replaced by the target's token and carry no label; the frozen draft's last
   hidden state at each drafted token is the feature.
4. Training: the head alone, soft weighted BCE with --weight-mismatch on rejections; the held-out
   loss is reported for the untrained head, the best constant predictor and the trained head,
   with the correlation of the trained head's predictions and the held-out labels.
5. Output: --out holds head.safetensors and head.json (shape, the fingerprints of the pair, and
   this run's record); samctl refuses the head with any other pair. A JSON summary goes to stdout.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shlex
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from samctl.decode.acceptance_head import (AcceptanceHead, Examples, HeadConfig, TrainConfig,
                                    collect_examples, evaluate_head, train_head, weighted_bce)
from samctl.decode.configs import SamplingConfig
from samctl.index.errors import UserError
from samctl.heads import model_fingerprint, save_head
from samctl.models import Engine, load_draft
from samctl.train.answers import own_answers, trainer_engine
from samctl.train.prompts import Prompt, read_prompts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="samctl train acc-head", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="target model folder")
    ap.add_argument("--draft", required=True, help="draft model folder (same tokenizer)")
    ap.add_argument("--prompts", action="append", required=True, metavar="INPUT",
                    help="training prompts: any input samctl build reads (folder, Alpaca / GSM8K / Spec-Bench "
                         "JSON(L), Parquet, hf:NAME, -); each record's first user turn; repeatable")
    ap.add_argument("--field", action="append", default=[], help="read prompts from this record field (repeatable)")
    ap.add_argument("--out", required=True, help="folder for head.safetensors + head.json")
    ap.add_argument("--num-prompts", type=int, default=300)
    ap.add_argument("--heldout", type=float, default=0.1, help="share of prompts kept for the held-out loss")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=384, help="longer prompts are skipped")
    ap.add_argument("--response-temperature", type=float, default=1.0, help="target responses: 0 = greedy")
    ap.add_argument("--response-batch", type=int, default=16, help="responses written at once by the batched engine")
    ap.add_argument("--cache", default="", help="folder for the responses (reused when model, prompts and settings match)")
    ap.add_argument("--no-chat", action="store_true", help="do not apply the tokenizer's chat template")
    ap.add_argument("--label-mode", choices=["sample", "greedy"], default="sample",
                    help="sample: z ~ q at T=1, label min(1, p/q) (paper); greedy: z = argmax q, label 1[argmax p = z]")
    ap.add_argument("--mixing-ratio", type=float, default=0.15)
    ap.add_argument("--weight-mismatch", type=float, default=6.0)
    ap.add_argument("--blocks", type=int, default=3, help="residual blocks")
    ap.add_argument("--independent-blocks", action="store_true", help="one weight set per block (default: shared)")
    ap.add_argument("--steps", type=int, default=2000, help="optimizer steps")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    return ap.parse_args(argv)


def examples_for(engine: Engine, draft, prompts: list[list[int]], responses: list[list[int]],
                 args: argparse.Namespace, generator: torch.Generator) -> Examples:
    parts = [collect_examples(engine.model, draft.model, p, r, args.mixing_ratio, generator,
                              greedy=args.label_mode == "greedy")
             for p, r in zip(prompts, responses)]
    return Examples.concat([part for part in parts if len(part)])


def constant_loss(train: Examples, heldout: Examples, weight: float) -> float:
    """Held-out loss of the best constant P(accept) fitted on the training labels."""
    y = train.labels
    # argmin_P of the weighted BCE: P = sum y / (sum y + w sum (1 - y))
    p = float(y.sum() / (y.sum() + weight * (1 - y).sum()))
    p = min(max(p, 1e-6), 1 - 1e-6)
    const = torch.log(torch.tensor([[1 - p, p]]))
    return float(weighted_bce(const.expand(len(heldout), 2), heldout.labels, weight))


def correlation(head: AcceptanceHead, examples: Examples) -> float:
    """Pearson correlation of the predicted P(accept) with the label: what a constant cannot do."""
    if len(examples) < 2:
        return float("nan")
    predicted = head.accept_prob(examples.features)
    return float(torch.corrcoef(torch.stack((predicted, examples.labels)))[0, 1])


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    train_config = TrainConfig(mixing_ratio=args.mixing_ratio, weight_mismatch=args.weight_mismatch,
                               steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    start = time.perf_counter()
    engine = trainer_engine(args, args.target)
    draft = load_draft(args.draft, engine)
    chat = not args.no_chat and bool(getattr(engine.tokenizer, "chat_template", None))

    texts = [p.turns[0] for p in read_prompts(args.prompts, args.field) if p.turns and p.turns[0].strip()]
    if not texts:
        raise UserError(f"no prompts in {', '.join(args.prompts)}: pass records with a user turn (--field to pick one)")
    random.Random(args.seed).shuffle(texts)
    room = min(engine.target.max_positions, draft.max_positions) - args.max_new_tokens
    texts = [t for t in texts[: args.num_prompts] if 0 < len(engine.encode(t, chat)) < room]

    tic = time.perf_counter()
    # the target's samples at --response-temperature; prompts longer than --max-prompt-tokens are left out
    answers = own_answers(engine, [Prompt("corpus", (text,)) for text in texts], chat, cache=args.cache,
                          name="acc-head", max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                          batch_size=args.response_batch, settings=(args.response_temperature, args.seed),
                          sampling=SamplingConfig(temperature=args.response_temperature, seed=args.seed))
    encoded, responses = [a.prompt_ids for a in answers], [a.output_ids for a in answers]
    respond_s = time.perf_counter() - tic
    n_heldout = max(1, round(args.heldout * len(encoded)))
    n_valid = max(1, round(0.1 * (len(encoded) - n_heldout)))
    if len(encoded) - n_heldout - n_valid < 1:
        raise UserError(f"only {len(encoded)} usable prompts: give more with --num-prompts or raise --max-prompt-tokens")
    generator = torch.Generator().manual_seed(args.seed)
    tic = time.perf_counter()
    parts = {}
    for name, lo, hi in (("heldout", 0, n_heldout), ("valid", n_heldout, n_heldout + n_valid),
                         ("train", n_heldout + n_valid, len(encoded))):
        parts[name] = examples_for(engine, draft, encoded[lo:hi], responses[lo:hi], args, generator)
    heldout, valid, train = parts["heldout"], parts["valid"], parts["train"]
    collect_s = time.perf_counter() - tic

    head = AcceptanceHead(HeadConfig(draft.hidden_size, args.blocks, not args.independent_blocks))
    before = evaluate_head(head, heldout, args.weight_mismatch)
    tic = time.perf_counter()
    history = train_head(head, train, train_config, valid if len(valid) else None)
    train_s = time.perf_counter() - tic
    after = evaluate_head(head, heldout, args.weight_mismatch)

    summary = {
        "command": "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "target": args.target, "draft": args.draft, "prompts": args.prompts,
        "prompts_used": {"train": len(encoded) - n_heldout - n_valid, "valid": n_valid, "heldout": n_heldout},
        "response_tokens": sum(len(r) for r in responses),
        "examples": {"train": len(train), "valid": len(valid), "heldout": len(heldout)},
        "mean_label": {"train": round(float(train.labels.mean()), 4),
                       "heldout": round(float(heldout.labels.mean()), 4) if len(heldout) else None},
        "heldout_loss": {"untrained": round(before, 5), "constant": round(constant_loss(train, heldout, args.weight_mismatch), 5),
                         "trained": round(after, 5)},
        "heldout_correlation": round(correlation(head, heldout), 4),
        "train_loss": {"first_pass": round(history[0], 5), "last_pass": round(history[-1], 5)},
        "config": {"args": vars(args), "train": dataclasses.asdict(train_config)},
        "seconds": {"responses": round(respond_s, 1), "examples": round(collect_s, 1), "training": round(train_s, 1),
                    "total": round(time.perf_counter() - start, 1)},
        "torch": torch.__version__,
    }
    save_head(args.out, head, model_fingerprint(engine.model, engine.tokenizer),
              model_fingerprint(draft.model, engine.tokenizer), summary)
    print(json.dumps(summary, indent=2))
    return summary


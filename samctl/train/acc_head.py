"""Train a SpecDec++ acceptance head for one target/draft pair (Huang, Guo & Wang 2024).

    samctl train acc-head --target samctl/models/default/target \
        --draft samctl/models/default/draft --prompts ../shared/data/codealpaca.json \
        --num-prompts 300 --out samctl/models/default/acc_head

The target answers the shuffled prompts (answers.py, cached under --cache); teacher-forced on each
answer, the draft drafts a token per position, labelled min(1, p/q) (--label-mode greedy: 1 when
it is the target's argmax) with its last hidden state as the feature, and --mixing-ratio of the
positions take the target's token unlabelled (`decode.acceptance_head.collect_examples`). The
head alone trains with weighted BCE, keeping its best pass on a validation tenth; reported are
the held-out losses of the untrained head, the best constant and the trained head, and the
trained head's correlation with the labels. --out gets head.safetensors and head.json (the
pair's fingerprints and this run's record); samctl refuses the head with any other pair.
"""
from __future__ import annotations

import dataclasses
import json
import random
import time
from dataclasses import dataclass

import torch

from samctl.decode.acceptance_head import (AcceptanceHead, Examples, HeadConfig, TrainConfig,
                                    collect_examples, evaluate_head, train_head, weighted_bce)
from samctl.decode.configs import SamplingConfig
from samctl.index.errors import UserError
from samctl.heads import model_fingerprint, save_head
from samctl.config import arg
from samctl.options import command_line, run_config_command
from samctl.models import Engine, load_draft
from samctl.train.answers import own_answers, trainer_engine
from samctl.train.prompts import Prompt, read_prompts


@dataclass(frozen=True)
class AccHeadTrainConfig:
    """`samctl train acc-head`'s settings (the optimizer's defaults TrainConfig's), recorded in head.json."""

    target: str = arg(help="target model folder")
    draft: str = arg(help="draft model folder (same tokenizer)")
    prompts: tuple[str, ...] = arg(help="training prompts: any input samctl build reads (folder, Alpaca / GSM8K / "
                                   "Spec-Bench JSON(L), Parquet, hf:NAME, -); each record's first user turn; repeatable",
                                   multiple=True, metavar="INPUT")
    out: str = arg(help="folder for head.safetensors + head.json")
    field: tuple[str, ...] = arg((), "read prompts from this record field (repeatable)", multiple=True)
    num_prompts: int = arg(300, "prompts read (training, validation and held out)")
    heldout: float = arg(0.1, "share of prompts kept for the held-out loss")
    max_new_tokens: int = arg(128, "length of the target's responses")
    max_prompt_tokens: int = arg(384, "longer prompts are skipped")
    response_temperature: float = arg(1.0, "target responses: 0 = greedy")
    response_batch: int = arg(16, "responses written at once by the batched engine")
    cache: str = arg("", "folder for the responses (reused when model, prompts and settings match)")
    no_chat: bool = arg(False, "do not apply the tokenizer's chat template")
    label_mode: str = arg("sample", "sample: z ~ q at T=1, label min(1, p/q) (paper); greedy: z = argmax q, label "
                          "1[argmax p = z]", choices=("sample", "greedy"))
    mixing_ratio: float = arg(TrainConfig.mixing_ratio, "share of drafted positions replaced by target tokens")
    weight_mismatch: float = arg(TrainConfig.weight_mismatch, "loss weight of the rejected class")
    blocks: int = arg(3, "residual blocks")
    independent_blocks: bool = arg(False, "one weight set per block (default: shared)")
    steps: int = arg(TrainConfig.steps, "optimizer steps")
    batch_size: int = arg(TrainConfig.batch_size, "examples per optimizer step")
    lr: float = arg(TrainConfig.lr, "learning rate")
    seed: int = arg(TrainConfig.seed, "seed of the prompt order, the responses and the training")
    device: str = arg("cpu", "cpu, cuda or cuda:N")
    threads: int = arg(0, "torch CPU threads (0: torch's default)")


def examples_for(engine: Engine, draft, prompts: list[list[int]], responses: list[list[int]],
                 config: AccHeadTrainConfig, generator: torch.Generator) -> Examples:
    parts = [collect_examples(engine.model, draft.model, p, r, config.mixing_ratio, generator,
                              greedy=config.label_mode == "greedy")
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
    """`samctl train acc-head ARGS...`: the summary, also written into the head's head.json."""
    return run_config_command(argv, "acc-head", AccHeadTrainConfig, run, __doc__.split("\n\n")[0])


def run(config: AccHeadTrainConfig) -> dict:
    train_config = TrainConfig(mixing_ratio=config.mixing_ratio, weight_mismatch=config.weight_mismatch,
                               steps=config.steps, batch_size=config.batch_size, lr=config.lr, seed=config.seed)
    start = time.perf_counter()
    engine = trainer_engine(config, config.target)
    draft = load_draft(config.draft, engine)
    chat = not config.no_chat and bool(getattr(engine.tokenizer, "chat_template", None))

    texts = [p.turns[0] for p in read_prompts(config.prompts, config.field) if p.turns and p.turns[0].strip()]
    if not texts:
        raise UserError(f"no prompts in {', '.join(config.prompts)}: pass records with a user turn (--field to pick one)")
    random.Random(config.seed).shuffle(texts)
    room = min(engine.target.max_positions, draft.max_positions) - config.max_new_tokens
    texts = [t for t in texts[: config.num_prompts] if 0 < len(engine.encode(t, chat)) < room]

    tic = time.perf_counter()
    # the target's samples at --response-temperature; prompts longer than --max-prompt-tokens are left out
    answers = own_answers(engine, [Prompt("corpus", (text,)) for text in texts], chat, cache=config.cache,
                          name="acc-head", max_new_tokens=config.max_new_tokens, max_prompt_tokens=config.max_prompt_tokens,
                          batch_size=config.response_batch, settings=(config.response_temperature, config.seed),
                          sampling=SamplingConfig(temperature=config.response_temperature, seed=config.seed))
    encoded, responses = [a.prompt_ids for a in answers], [a.output_ids for a in answers]
    respond_s = time.perf_counter() - tic
    n_heldout = max(1, round(config.heldout * len(encoded)))
    n_valid = max(1, round(0.1 * (len(encoded) - n_heldout)))
    if len(encoded) - n_heldout - n_valid < 1:
        raise UserError(f"only {len(encoded)} usable prompts: give more with --num-prompts or raise --max-prompt-tokens")
    generator = torch.Generator().manual_seed(config.seed)
    tic = time.perf_counter()
    heldout, valid, train = (examples_for(engine, draft, encoded[lo:hi], responses[lo:hi], config, generator)
                             for lo, hi in ((0, n_heldout), (n_heldout, n_heldout + n_valid),
                                            (n_heldout + n_valid, len(encoded))))
    collect_s = time.perf_counter() - tic

    head = AcceptanceHead(HeadConfig(draft.hidden_size, config.blocks, not config.independent_blocks))
    before = evaluate_head(head, heldout, config.weight_mismatch)
    tic = time.perf_counter()
    history = train_head(head, train, train_config, valid if len(valid) else None)
    train_s = time.perf_counter() - tic
    after = evaluate_head(head, heldout, config.weight_mismatch)

    summary = {
        "command": command_line("train", "acc-head"),
        "target": config.target, "draft": config.draft, "prompts": config.prompts,
        "prompts_used": {"train": len(encoded) - n_heldout - n_valid, "valid": n_valid, "heldout": n_heldout},
        "response_tokens": sum(len(r) for r in responses),
        "examples": {"train": len(train), "valid": len(valid), "heldout": len(heldout)},
        "mean_label": {"train": round(float(train.labels.mean()), 4),
                       "heldout": round(float(heldout.labels.mean()), 4) if len(heldout) else None},
        "heldout_loss": {"untrained": round(before, 5), "constant": round(constant_loss(train, heldout, config.weight_mismatch), 5),
                         "trained": round(after, 5)},
        "heldout_correlation": round(correlation(head, heldout), 4),
        "train_loss": {"first_pass": round(history[0], 5), "last_pass": round(history[-1], 5)},
        "config": {"args": dataclasses.asdict(config), "train": dataclasses.asdict(train_config)},
        "seconds": {"responses": round(respond_s, 1), "examples": round(collect_s, 1), "training": round(train_s, 1),
                    "total": round(time.perf_counter() - start, 1)},
        "torch": torch.__version__,
    }
    save_head(config.out, head, model_fingerprint(engine.model, engine.tokenizer),
              model_fingerprint(draft.model, engine.tokenizer), summary)
    print(json.dumps(summary, indent=2))
    return summary


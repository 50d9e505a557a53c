"""Train an EAGLE head for a target model (METHODS.md section 3), then measure it.

    samctl train eagle --model /work/runs/smollm2 --data-dir ../shared/data \\
        --cache ../runs/eagle --out ../runs/eagle/smollm2_head --max-tokens 150000 --minutes 25 \\
        --threads 1 --replay ../runs/data/specbench_refs.jsonl
    samctl train eagle --device cuda --model M --data-dir D --out H --max-tokens 5000000 --epochs 4

1. Data: the instructions of --data-dir (GSM8K train, Code Alpaca, GPTeacher role-play; the
   reference models' mixture without its synthetic copy tasks), any that is a turn of
   --exclude (Spec-Bench, whose questions the replay traces answer) dropped, shuffled with --seed,
   rendered with the model's chat template (user turn, then the response as the assistant's) and
   taken up to --max-tokens; --heldout sequences are kept apart. Responses: --responses self (the
   default) has the target write its own greedy answers (samctl/train/answers.py: batched `generate`,
   --max-new-tokens, cached in --cache per model and selection, so a rerun or a larger
   --max-tokens reuses them), which is what replay and acceptance measure; --responses data uses
   the sets' fixed human answers, as EAGLE does with ShareGPT.
2. Features: one target forward per sequence gives its post-norm last hidden states and greedy
   choices; they are computed once and cached in --cache (safetensors, keyed by the model's
   fingerprint and the data selection), never in the repository.
3. Training: the head alone (fc over [embedding, feature] + one decoder layer of the target's
   architecture; the target's embedding and lm_head frozen): SmoothL1 on the next feature plus
   0.1 x cross-entropy against the target's next token, uniform feature noise, AdamW with
   warm-up and cosine decay, on response positions only; --max-steps or --minutes. With
   --draft-vocab N the head drafts (and its cross-entropy ranges over) only the N tokens the
   target chooses most often in the training part, which makes its output layer V / N times cheaper.
4. Report: held-out top-1 accuracy (the head's next-token argmax equals the target's, teacher-
   forced), before and after training (and of --baseline-head, an earlier head, on the same
   held-out positions), and, with --replay (reference traces: the target's own
   greedy outputs, e.g. tools/gen_references.py), tokens per step of `eagle`, `sam+eagle`,
   `adaptive+eagle` and `adaptive` in replay (decode.simulate.replay with the target's features,
   no target forward per step; Token Recycle, which learns from logits, is off in a replay).
5. Output: --out holds eagle.safetensors and eagle.json (the target's fingerprint and this run's
   record); samctl refuses the head for any other model. A JSON summary goes to stdout.

CPU mode (the default device there) keeps every process to --threads; GPU mode (--device cuda)
only changes where the forwards run and allows larger --max-tokens / --batch-tokens.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shlex
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

from samctl.decode.engine.cost import relative_cost
from samctl.decode.drafters.eagle import EagleConfig
from samctl.decode.methods import DEFAULT_METHOD, EAGLE_METHODS, MethodConfig, make_drafter
from samctl.decode.eagle_head import EagleHead, eagle_loss, target_features
from samctl.decode.simulate import Tally, make_trace, replay
from samctl.index.errors import UserError
from samctl.eagle_heads import save_eagle_head
from samctl.gguf_cache import cache_dir
from samctl.heads import model_fingerprint
from samctl.runtime import Engine, load_engine
from samctl.train.answers import cached_responses
from samctl.train.prompts import read_instruction_rows


def read_pairs(data_dir: Path) -> list[tuple[str, str, str]]:
    """(source, instruction, response) from the instruction sets present in data_dir (the reference
    models' reader, tools/train_reference.py)."""
    rows = [(name, instruction, response) for name, pairs in read_instruction_rows(data_dir).items()
            for instruction, response in pairs]
    if not rows:
        raise UserError(f"{data_dir} holds none of gsm8k_train.jsonl, codealpaca.json, gpteacher_roleplay.json: "
                        "pass --data-dir with the shared data folder")
    return rows


def _normal(text: str) -> str:
    return " ".join(text.split()).lower()


def drop_excluded(rows: list[tuple[str, str, str]], exclude: Path | None) -> tuple[list[tuple[str, str, str]], int]:
    """Rows whose instruction is not (whitespace and case aside) a turn of the question file
    `exclude` (Spec-Bench's question.jsonl: {"turns": [...]} per line); -> (rows, number dropped)."""
    if exclude is None or not Path(exclude).exists():
        return rows, 0
    turns = {_normal(turn) for line in Path(exclude).read_text(encoding="utf-8").splitlines() if line.strip()
             for turn in json.loads(line).get("turns", [])}
    kept = [row for row in rows if _normal(row[1]) not in turns]
    return kept, len(rows) - len(kept)


def encode_pair(engine: Engine, instruction: str, response: str, max_len: int) -> tuple[np.ndarray, int]:
    """-> (ids [n] of prompt + response + EOS, cut at max_len; the prompt's length)."""
    tok = engine.tokenizer
    if getattr(tok, "chat_template", None):
        prompt = engine.encode(instruction, chat=True)
    else:
        prompt = tok(instruction + "\n\n")["input_ids"]
    answer = tok(response, add_special_tokens=False)["input_ids"] + list(engine.eos_token_ids[:1])
    ids = np.asarray((prompt + answer)[:max_len], dtype=np.int64)
    return ids, min(len(prompt), len(ids))


def build_sequences(engine: Engine, args, fingerprint: str, log) -> tuple[list[np.ndarray], list[int], dict]:
    """-> (sequences [n_i] int64 of prompt + response, their prompt lengths, a record of the selection)."""
    rows, dropped = drop_excluded(read_pairs(Path(args.data_dir)), args.exclude)
    random.Random(args.seed).shuffle(rows)
    record = {"responses": args.responses, "excluded_instructions": dropped}
    if args.responses == "data":
        seqs, prompt_lens = _take((encode_pair(engine, instruction, response, args.max_len)
                                   for _, instruction, response in rows), args.max_tokens)
        return seqs, prompt_lens, record
    # self-distilled: the target answers the shuffled prompts in order until --max-tokens is reached
    encode = ((lambda text: engine.encode(text, chat=True)) if getattr(engine.tokenizer, "chat_template", None)
              else (lambda text: engine.tokenizer(text + "\n\n")["input_ids"]))
    prompts = [encode(instruction)[: args.max_len // 2] for _, instruction, _ in rows]
    key = hashlib.sha256(json.dumps([fingerprint, args.data_dir, args.seed, args.max_len, args.max_new_tokens,
                                     dropped], sort_keys=True).encode()).hexdigest()[:16]

    def enough(answers: list[list[int]]) -> bool:
        return sum(min(len(p) + len(a), args.max_len) for p, a in zip(prompts, answers)) >= args.max_tokens

    answers = cached_responses(engine, prompts, args.max_new_tokens, args.response_batch, Path(args.cache), key,
                               enough=enough, log=log)
    seqs, prompt_lens = _take(((np.asarray((prompt + answer)[: args.max_len], dtype=np.int64), len(prompt))
                               for prompt, answer in zip(prompts, answers)), args.max_tokens)
    record.update(responses_key=key, max_new_tokens=args.max_new_tokens,
                  responses_ending_in_eos=sum(bool(a) and a[-1] in engine.eos_token_ids for a in answers[: len(seqs)]))
    return seqs, prompt_lens, record


def _take(pairs, max_tokens: int) -> tuple[list[np.ndarray], list[int]]:
    """(ids, prompt length) pairs with at least 4 response tokens, in order, until max_tokens."""
    seqs, prompt_lens, total = [], [], 0
    for ids, p in pairs:
        if len(ids) - p < 4:
            continue
        seqs.append(ids)
        prompt_lens.append(p)
        total += len(ids)
        if total >= max_tokens:
            break
    return seqs, prompt_lens


def cached_features(engine: Engine, seqs: list[np.ndarray], cache: Path, key: str, log) -> tuple[torch.Tensor, torch.Tensor]:
    """Features [T, H] float16 and choices [T] int32 of every sequence, concatenated; computed once."""
    from safetensors.torch import load_file, save_file

    path = cache / f"features-{key}.safetensors"
    if path.exists():
        data = load_file(str(path))
        log(f"features: {path} (cached)")
        return data["features"], data["choices"]
    feats, choices = [], []
    tic, done = time.time(), 0
    for i, ids in enumerate(seqs):
        f, c = target_features(engine.model, torch.from_numpy(ids).to(engine.device))
        feats.append(f.half().cpu())
        choices.append(c.int().cpu())
        done += len(ids)
        if time.time() - tic > 30 and i % 50 == 0:
            log(f"features: {i + 1}/{len(seqs)} sequences, {done / (time.time() - tic):.0f} tokens/s")
    features, choice = torch.cat(feats), torch.cat(choices)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({"features": features, "choices": choice}, str(tmp))
    os.replace(tmp, path)
    log(f"features: {len(seqs)} sequences, {done} tokens in {time.time() - tic:.0f} s -> {path}")
    return features, choice


class Batches:
    """Random windows of whole sequences, padded, about `batch_tokens` tokens per batch."""

    def __init__(self, seqs, prompt_lens, offsets, features, choices, batch_tokens, seed):
        self.seqs, self.prompt_lens, self.offsets = seqs, prompt_lens, offsets
        self.features, self.choices = features, choices
        self.batch_tokens, self.rng = batch_tokens, random.Random(seed)

    def batch(self, indices: list[int], device) -> tuple[torch.Tensor, ...]:
        n = max(len(self.seqs[i]) for i in indices)
        B, H = len(indices), self.features.shape[1]
        feats = torch.zeros(B, n, H)
        tokens = torch.zeros(B, n, dtype=torch.int64)
        choices = torch.zeros(B, n, dtype=torch.int64)
        weights = torch.zeros(B, n)
        for b, i in enumerate(indices):
            m, start = len(self.seqs[i]), self.offsets[i]
            feats[b, :m] = self.features[start : start + m].float()
            tokens[b, :m] = torch.from_numpy(self.seqs[i])
            choices[b, :m] = self.choices[start : start + m].long()
            # pair j predicts position j + 1's feature, whose token is x_{j+2}: count it when x_{j+2}
            # is a response token (weights are read at j + 1 by eagle_loss)
            weights[b, max(self.prompt_lens[i] - 1, 1) : m - 1] = 1.0
        return tuple(t.to(device) for t in (feats, tokens, choices, weights))

    def sample(self, pool: list[int]) -> list[int]:
        picked, tokens = [], 0
        while tokens < self.batch_tokens:
            i = self.rng.choice(pool)
            picked.append(i)
            tokens += len(self.seqs[i])
        return picked


def evaluate(head: EagleHead, batches: Batches, pool: list[int], device) -> dict:
    head.eval()
    hits = count = regression = 0.0
    with torch.no_grad():
        for start in range(0, len(pool), 8):
            f, t, c, w = batches.batch(pool[start : start + 8], device)
            _, stats = eagle_loss(head, f, t, c, w, noise=0.0)
            hits += stats["top1_hits"]
            count += stats["count"]
            regression += stats["regression"] * stats["count"]
    head.train()
    return {"top1": round(hits / max(count, 1), 4), "regression": round(regression / max(count, 1), 4),
            "positions": int(count)}


def train(head: EagleHead, batches: Batches, train_pool: list[int], args, log) -> dict:
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    deadline = time.time() + 60 * args.minutes if args.minutes else math.inf
    steps = args.max_steps
    tic, step, seen, last_log = time.time(), 0, 0, time.time()
    head.train()
    while step < steps and time.time() < deadline:
        # the schedule follows whichever budget ends first: steps or the clock
        progress = min(1.0, max(step / steps, (time.time() - tic) / (60 * args.minutes) if args.minutes else 0.0))
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in opt.param_groups:
            group["lr"] = lr
        f, t, c, w = batches.batch(batches.sample(train_pool), args.device)
        loss, stats = eagle_loss(head, f, t, c, w, noise=args.noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_value_(params, 0.5)
        opt.step()
        step += 1
        seen += int(stats["count"])
        if time.time() - last_log > 60:
            last_log = time.time()
            log(f"step {step}: loss {loss.item():.4f} (regression {stats['regression']:.4f}, ce {stats['ce']:.3f}), "
                f"top1 {stats['top1_hits'] / max(stats['count'], 1):.3f}, {seen / (time.time() - tic):.0f} positions/s")
    return {"steps": step, "positions_seen": seen, "seconds": round(time.time() - tic, 1)}


# every EAGLE method beside the default one, which replays without its Token Recycle part (no
# logits in a replay), in both of its rows
REPLAYED = EAGLE_METHODS + (DEFAULT_METHOD,)


def replay_traces(engine: Engine, head: EagleHead, path: Path, cost: np.ndarray | None, max_new_tokens: int,
                  config: EagleConfig) -> dict:
    """tokens/step of the REPLAYED methods on reference traces (target features by one
    teacher-forced forward per trace), per category."""
    out: dict[str, dict[str, Tally]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        trace = make_trace(row["prompt_ids"], row["output_ids"], engine.eos_token_ids, max_new_tokens,
                           category=row.get("category", ""), trace_id=str(row.get("id", "")))
        ids = torch.from_numpy(np.concatenate((trace.prompt, trace.reference))).to(engine.device)
        hidden, _ = target_features(engine.model, ids)
        hidden = hidden.to(next(head.parameters()).dtype)
        group = "mt_bench" if row.get("question_id", 0) in range(81, 161) else trace.category
        for name in REPLAYED:
            drafter = make_drafter(name, vocab_size=engine.vocab_size, device=engine.device, cost=cost, eagle=head,
                                   eos_token_ids=engine.eos_token_ids, config=MethodConfig(eagle=config))
            drafter.remember = False  # no memory across traces: each trace stands alone, as in bench
            metrics = replay(drafter, trace, hidden=hidden)
            out.setdefault(name, {}).setdefault(group, Tally()).add(metrics)
    return {name: {group: {"traces": t.traces, "tokens_per_step": round(t.mean_accepted, 3),
                           "drafted_per_step": round(t.drafted / max(t.steps, 1), 1),
                           "draft_ms_per_step": round(1e3 * t.draft_s / max(t.steps, 1), 2)}
                   for group, t in groups.items()} for name, groups in out.items()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="samctl train eagle", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="target model folder or .gguf")
    p.add_argument("--out", required=True, help="head folder to write")
    p.add_argument("--data-dir", required=True, help="folder with gsm8k_train.jsonl, codealpaca.json, gpteacher_roleplay.json")
    p.add_argument("--cache", default=str(cache_dir() / "train-eagle"),
                   help="folder for the self-written answers and target features, reused by later runs "
                        "[default: samctl's cache, $SAMCTL_CACHE or ~/.cache/samctl]")
    p.add_argument("--max-tokens", type=int, default=150_000, help="training + held-out tokens")
    p.add_argument("--responses", choices=("self", "data"), default="self",
                   help="self: the target's own greedy answers (cached); data: the sets' fixed answers")
    p.add_argument("--max-new-tokens", type=int, default=192, help="longest self-written answer")
    p.add_argument("--response-batch", type=int, default=32, help="prompts per batched generate call")
    p.add_argument("--exclude", type=Path, default=None,
                   help="question file whose turns never enter training (default: DATA_DIR/specbench_question.jsonl)")
    p.add_argument("--baseline-head", type=Path, default=None,
                   help="an earlier head of the same target: its held-out top-1 on this run's held-out set")
    p.add_argument("--max-len", type=int, default=768, help="longest sequence (tokens)")
    p.add_argument("--heldout", type=int, default=60, help="sequences kept apart for the held-out accuracy")
    p.add_argument("--max-steps", type=int, default=2000)
    p.add_argument("--minutes", type=float, default=None, help="stop training after this long (the report records the steps)")
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="draft only the N most frequent target tokens (cheaper head forwards on a large vocabulary); 0 = all")
    p.add_argument("--noise", type=float, default=0.2, help="uniform feature noise width (EAGLE: 0.2)")
    p.add_argument("--replay", type=Path, default=None, help="reference traces (prompt_ids, output_ids) to replay")
    p.add_argument("--replay-max-new-tokens", type=int, default=256)
    p.add_argument("--replay-only", action="store_true", help="no training: replay the head already in --out")
    p.add_argument("--cost", type=Path, default=None,
                   help="verify-cost curve JSON ({t_ms: [...]}, samctl calibrate --json) to size replayed trees "
                        "(default: the linear GPU-like curve, 0.5%% per node)")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.exclude is None:
        args.exclude = Path(args.data_dir) / "specbench_question.jsonl"
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    def log(text: str) -> None:
        print(f"[train_eagle {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)

    engine = load_engine(args.model, args.device, "float32", quiet=True, prepack=False)  # trains on unpacked weights
    args.device = engine.device
    cost = None
    if args.cost is not None:
        cost = relative_cost(json.loads(args.cost.read_text(encoding="utf-8"))["t_ms"])
    if args.replay_only:  # measure an existing head (--out) on --replay, e.g. under another cost curve
        from samctl.eagle_heads import load_eagle_head

        head = load_eagle_head(args.out, engine.model, model_fingerprint(engine.model, engine.tokenizer))
        result = {"head": args.out, "file": str(args.replay), "cost": str(args.cost),
                  **replay_traces(engine, head, args.replay, cost, args.replay_max_new_tokens, EagleConfig())}
        print(json.dumps(result, indent=2))
        return result
    for param in engine.model.parameters():
        param.requires_grad_(False)
    fingerprint = model_fingerprint(engine.model, engine.tokenizer)
    seqs, prompt_lens, selection = build_sequences(engine, args, fingerprint, log)
    # data mode keeps the key of the first heads' caches; a self-distilled selection adds its responses
    key_parts = [fingerprint, args.data_dir, args.max_tokens, args.max_len, args.seed]
    if args.responses == "self":
        key_parts.append(selection["responses_key"])
    if selection["excluded_instructions"]:
        key_parts.append(selection["excluded_instructions"])
    key = hashlib.sha256(json.dumps(key_parts, sort_keys=True).encode()).hexdigest()[:16]
    features, choices = cached_features(engine, seqs, Path(args.cache), key, log)
    offsets = np.concatenate(([0], np.cumsum([len(s) for s in seqs])[:-1]))
    heldout = list(range(min(args.heldout, len(seqs) // 5)))
    train_pool = list(range(len(heldout), len(seqs)))
    batches = Batches(seqs, prompt_lens, offsets, features, choices, args.batch_tokens, args.seed)
    vocab = None
    if 0 < args.draft_vocab < engine.vocab_size:  # the most frequent target choices of the training part
        counts = torch.bincount(choices[int(offsets[len(heldout)]) if train_pool else 0 :].long(), minlength=engine.vocab_size)
        vocab = counts.topk(args.draft_vocab).indices.sort().values
        log(f"draft vocabulary: {args.draft_vocab} tokens cover {float(counts[vocab].sum() / counts.sum()):.3f} "
            "of the target's choices")
    baseline = None
    if args.baseline_head is not None:  # an earlier head on the same held-out positions
        from samctl.eagle_heads import load_eagle_head

        baseline = evaluate(load_eagle_head(args.baseline_head, engine.model, fingerprint), batches, heldout,
                            engine.device)
        log(f"baseline head {args.baseline_head}: held-out top1 {baseline['top1']}")
    head = EagleHead(engine.model, vocab=vocab).to(engine.device)
    before = evaluate(head, batches, heldout, engine.device)
    log(f"{len(seqs)} sequences ({int(sum(map(len, seqs)))} tokens), {len(heldout)} held out; untrained top1 {before['top1']}")
    run = train(head, batches, train_pool, args, log)
    after = evaluate(head, batches, heldout, engine.device)
    log(f"trained {run['steps']} steps in {run['seconds']} s: held-out top1 {after['top1']}")
    report = {
        "command": "python " + shlex.join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
        "model": str(args.model), "data": {"dir": str(args.data_dir), "sequences": len(seqs),
                                           "tokens": int(sum(map(len, seqs))), "heldout_sequences": len(heldout),
                                           **selection},
        "config": {k: (str(v) if isinstance(v, (Path, torch.device)) else v) for k, v in vars(args).items()},
        "run": run, "heldout_before": before, "heldout": after, "torch": torch.__version__,
        **({"heldout_baseline": {"head": str(args.baseline_head), **baseline}} if baseline is not None else {}),
    }
    save_eagle_head(args.out, head, fingerprint, report)
    if args.replay is not None:
        head.eval()
        report["replay"] = {"file": str(args.replay), "cost": str(args.cost),
                            **replay_traces(engine, head, args.replay, cost, args.replay_max_new_tokens, EagleConfig())}
        save_eagle_head(args.out, head, fingerprint, report)
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    try:
        main()
    except UserError as err:
        sys.exit(f"train_eagle: {err}")

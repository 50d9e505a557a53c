"""Train an EAGLE head for a target model (EAGLE-2, Li et al. 2024), then measure it.

    samctl train eagle --model models/SmolLM2-135M-Instruct.Q4_1.gguf --mixture ../shared/data \\
        --exclude ../shared/data/specbench_question.jsonl --out head/ --max-tokens 1000000 \\
        --answer-minutes 40 --draft-vocab 8192 --minutes 20 --threads 1 --replay refs.jsonl
    samctl train eagle --device cuda --model M --prompts prompts.jsonl --out H --max-tokens 5000000

The head trains alone with EAGLE's loss on the target's own greedy answers (answers.py) to
--prompts and the --mixture (prompts.py), less those with a turn of --exclude, and on the target's
features at them; answers and features are cached under --cache, so a rerun goes on where the last
stopped. On its own greedy answers the target's choice at each position is the next token, so no
output layer runs. The report: held-out top-1 before and after (and of --baseline-head), and with
--replay the tokens per step of the EAGLE methods replayed on reference traces. --out gets
eagle.safetensors and eagle.json (the target's fingerprint and this run's record).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from samctl.decode.engine.cost import relative_cost
from samctl.decode.drafters.eagle import EagleConfig
from samctl.decode.methods import DEFAULT_METHOD, EAGLE_METHODS, MethodConfig, make_drafter
from samctl.decode.eagle_head import EagleHead, eagle_loss, target_features
from samctl.decode.simulate import Tally, make_trace, replay
from samctl.index.errors import UserError
from samctl.heads import load_eagle_head, model_fingerprint, save_eagle_head
from samctl.gguf_cache import cache_dir
from samctl.config import arg
from samctl.options import command_line, run_config_command
from samctl.models import Engine
from samctl.train.answers import Answer, answers_key, trainer_engine, write_answers
from samctl.train.prompts import Prompt, drop_excluded, mixture, read_prompts


@dataclass(frozen=True)
class EagleTrainConfig:
    """`samctl train eagle`'s settings, recorded in the head's eagle.json."""

    model: str = arg(help="target model folder or .gguf")
    out: str = arg(help="head folder to write")
    prompts: tuple[str, ...] = arg((), "training prompts: any input samctl build reads (folder, JSON/JSONL/Parquet "
                                   "records, hf:NAME, -); a record's user turns are answered one after the other; "
                                   "repeatable", multiple=True, metavar="INPUT")
    field: tuple[str, ...] = arg((), "read prompts from this record field (repeatable)", multiple=True)
    mixture: str | None = arg(None, "the built-in mixture (samctl/train/prompts.py): math, code, role-play, two-turn "
                              "chat from the instruction sets in DIR (gsm8k_train.jsonl, codealpaca.json, "
                              "gpteacher_roleplay.json; any may be absent), translation and summarization from local "
                              "text", metavar="DIR")
    cache: str | None = arg(None, "folder for the self-written answers and target features, reused by later runs "
                            "[default: samctl's cache, $SAMCTL_CACHE or ~/.cache/samctl]")
    max_tokens: int = arg(150_000, "training + held-out tokens (prompts and answers)")
    max_new_tokens: int = arg(256, "longest self-written answer")
    answer_method: str = arg(DEFAULT_METHOD, "lossless method of the batched engine that writes the answers "
                             "(greedy: any gives the same)")
    batch_size: int = arg(32, "answers written at once by the batched engine")
    answer_minutes: float | None = arg(None, "stop writing answers after this long (a rerun goes on where this one "
                                       "stopped)", type=float)
    exclude: tuple[str, ...] = arg((), "prompts with a turn of these inputs never enter training (Spec-Bench's "
                                   "question.jsonl); repeatable", multiple=True, metavar="INPUT")
    baseline_head: str | None = arg(None, "an earlier head of the same target: its held-out top-1 on this run's "
                                    "held-out set")
    max_len: int = arg(768, "longest sequence (tokens)")
    heldout: int = arg(60, "sequences kept apart for the held-out accuracy")
    max_steps: int = arg(2000, "optimizer steps")
    minutes: float | None = arg(None, "stop training after this long (the report records the steps)", type=float)
    batch_tokens: int = arg(2048, "tokens per training batch")
    lr: float = arg(1e-3, "peak learning rate")
    warmup: int = arg(50, "warm-up steps")
    draft_vocab: int = arg(0, "draft only the N most frequent target tokens (cheaper head forwards on a large "
                           "vocabulary); 0 = all")
    noise: float = arg(0.2, "uniform feature noise width (EAGLE: 0.2)")
    replay: str | None = arg(None, "reference traces (prompt_ids, output_ids) to replay")
    replay_max_new_tokens: int = arg(256, "reference tokens replayed per trace")
    replay_only: bool = arg(False, "no training: replay the head already in --out")
    cost: str | None = arg(None, "verify-cost curve JSON ({t_ms: [...]}, samctl calibrate --json) to size replayed "
                           "trees (default: the linear GPU-like curve, 0.5% per node)")
    device: str = arg("auto", "auto, cpu, cuda or cuda:N")
    threads: int | None = arg(None, "torch CPU threads (default: torch's choice)", type=int)
    seed: int = arg(0, "seed of the prompt mixture, the batches and the head's initialization")


def read_training_prompts(config: EagleTrainConfig) -> tuple[list[Prompt], dict]:
    """--prompts inputs, then the built-in --mixture, less every prompt with a turn of --exclude."""
    prompts = read_prompts(config.prompts, config.field) if config.prompts else []
    if config.mixture is not None:
        prompts += mixture(Path(config.mixture), config.seed)
    if not prompts:
        raise UserError("no training prompts: pass --prompts INPUT (any input samctl build reads) or --mixture DIR")
    prompts, dropped = drop_excluded(prompts, config.exclude)
    return prompts, {"prompts": len(prompts), "excluded_prompts": dropped}


def write_training_answers(config: EagleTrainConfig, prompts: list[Prompt], fingerprint: dict, log) -> tuple[list[Answer], dict]:
    """The target's own greedy answers to `prompts` in cache/answers-<key>.jsonl, until --max-tokens
    or --answer-minutes. Its own session: prepacked weights answer faster, training needs plain ones."""
    from samctl.config import SessionConfig
    from samctl.session import Session

    max_prompt = config.max_len // 2
    key = answers_key(fingerprint, prompts, config.max_new_tokens, max_prompt)
    path = Path(config.cache) / f"answers-{key}.jsonl"
    session = Session(SessionConfig(model=config.model, device=config.device, dtype="float32", threads=config.threads,
                                    method=config.answer_method, max_new_tokens=config.max_new_tokens, quiet=True))
    session = session.for_method(config.answer_method, chat=bool(getattr(session.engine.tokenizer, "chat_template", None)))
    deadline = time.time() + 60 * config.answer_minutes if config.answer_minutes else None
    tic = time.time()
    answers = write_answers(session, prompts, path, batch_size=config.batch_size, max_prompt_tokens=max_prompt,
                            max_tokens=config.max_tokens, deadline=deadline, log=log)
    kinds: Counter[str] = Counter()
    for answer in answers:
        kinds[answer.kind] += answer.tokens
    record = {"answers": str(path), "answers_key": key, "answer_method": config.answer_method,
              "batch_size": config.batch_size, "max_new_tokens": config.max_new_tokens, "turns": len(answers),
              "tokens_by_kind": kinds, "answer_seconds_this_run": round(time.time() - tic, 1),
              "answers_ending_in_eos": sum(bool(a.output_ids) and a.output_ids[-1] in session.engine.eos_token_ids
                                          for a in answers)}
    return answers, record


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


def cached_features(engine: Engine, seqs: list[np.ndarray], cache: Path, model_key: str, log,
                    shard: int = 64, batch_tokens: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Features [T, H] float16 (the target's post-norm last hidden states) and choices [T] int32 of
    every sequence, concatenated; choices[j] = ids[j + 1] (the last repeats its token; no loss
    reads it). Shards of `shard` sequences are cached in `cache` under the model and their ids, so a
    rerun computes only new ones; sequences of like length share a right-padded (causal) forward."""
    from safetensors.torch import load_file, save_file

    cache.mkdir(parents=True, exist_ok=True)
    decoder = engine.model.get_decoder()
    feats, tic, computed = [], time.time(), 0
    for start in range(0, len(seqs), shard):
        part = seqs[start : start + shard]
        digest = hashlib.sha256(model_key.encode())
        for ids in part:
            digest.update(ids.astype("<i8").tobytes() + b"|")
        path = cache / f"features-{digest.hexdigest()[:20]}.safetensors"
        if path.exists():
            feats.append(load_file(str(path))["features"])
            continue
        out: list[torch.Tensor | None] = [None] * len(part)
        order = sorted(range(len(part)), key=lambda i: len(part[i]))
        group: list[int] = []
        for n, i in enumerate(order):
            group.append(i)
            width = len(part[group[-1]])
            if n + 1 == len(order) or (len(group) + 1) * len(part[order[n + 1]]) > batch_tokens:
                ids = torch.zeros(len(group), width, dtype=torch.int64)
                for b, j in enumerate(group):
                    ids[b, : len(part[j])] = torch.from_numpy(part[j])
                with torch.inference_mode():
                    hidden = decoder(input_ids=ids.to(engine.device)).last_hidden_state
                for b, j in enumerate(group):
                    out[j] = hidden[b, : len(part[j])].half().cpu()
                group = []
        shard_features = torch.cat(out)
        tmp = path.with_suffix(".tmp")
        save_file({"features": shard_features}, str(tmp))
        os.replace(tmp, path)
        feats.append(shard_features)
        computed += sum(map(len, part))
        log(f"features: {start + len(part)}/{len(seqs)} sequences, {computed} tokens computed at "
            f"{computed / (time.time() - tic):.0f} tokens/s")
    choices = torch.from_numpy(np.concatenate([np.append(ids[1:], ids[-1:]) for ids in seqs]).astype(np.int32))
    return torch.cat(feats), choices


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


def train(head: EagleHead, batches: Batches, train_pool: list[int], config: EagleTrainConfig, log) -> dict:
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    deadline = time.time() + 60 * config.minutes if config.minutes else math.inf
    steps = config.max_steps
    tic, step, seen, last_log = time.time(), 0, 0, time.time()
    head.train()
    while step < steps and time.time() < deadline:
        # the schedule follows whichever budget ends first: steps or the clock
        progress = min(1.0, max(step / steps, (time.time() - tic) / (60 * config.minutes) if config.minutes else 0.0))
        lr = config.lr * min(1.0, (step + 1) / config.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in opt.param_groups:
            group["lr"] = lr
        f, t, c, w = batches.batch(batches.sample(train_pool), head.fc.weight.device)
        loss, stats = eagle_loss(head, f, t, c, w, noise=config.noise)
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
    """tokens/step of the REPLAYED methods on reference traces, per category."""
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
    """`samctl train eagle ARGS...`: the report, also written into the head's eagle.json."""
    return run_config_command(argv, "eagle", EagleTrainConfig, run, __doc__.split("\n\n")[0])


def run(config: EagleTrainConfig) -> dict:
    def log(text: str) -> None:
        print(f"[train_eagle {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)

    config = replace(config, cache=config.cache or str(cache_dir() / "train-eagle"))
    engine = trainer_engine(config, config.model)
    traces = Path(config.replay) if config.replay is not None else None
    cost = (relative_cost(json.loads(Path(config.cost).read_text(encoding="utf-8"))["t_ms"])
            if config.cost is not None else None)
    if config.replay_only:  # measure an existing head (--out) on --replay, e.g. under another cost curve
        head = load_eagle_head(config.out, engine.model, model_fingerprint(engine.model, engine.tokenizer))
        result = {"head": config.out, "file": str(config.replay), "cost": str(config.cost),
                  **replay_traces(engine, head, traces, cost, config.replay_max_new_tokens, EagleConfig())}
        print(json.dumps(result, indent=2))
        return result
    engine.model.requires_grad_(False)
    fingerprint = model_fingerprint(engine.model, engine.tokenizer)
    prompts, selection = read_training_prompts(config)
    answers, written = write_training_answers(config, prompts, fingerprint, log)
    selection.update(written)
    seqs, prompt_lens = _take(((np.asarray((a.prompt_ids + a.output_ids)[: config.max_len], dtype=np.int64),
                                len(a.prompt_ids)) for a in answers), config.max_tokens)
    features, choices = cached_features(engine, seqs, Path(config.cache), json.dumps(fingerprint, sort_keys=True), log)
    offsets = np.concatenate(([0], np.cumsum([len(s) for s in seqs])[:-1]))
    heldout = list(range(min(config.heldout, len(seqs) // 5)))
    train_pool = list(range(len(heldout), len(seqs)))
    batches = Batches(seqs, prompt_lens, offsets, features, choices, config.batch_tokens, config.seed)
    vocab = None
    if 0 < config.draft_vocab < engine.vocab_size:  # the most frequent target choices of the training part
        chosen = np.concatenate([seqs[i][prompt_lens[i]:] for i in train_pool or heldout])
        counts = torch.bincount(torch.from_numpy(chosen), minlength=engine.vocab_size)
        vocab = counts.topk(config.draft_vocab).indices.sort().values
        log(f"draft vocabulary: {config.draft_vocab} tokens cover {float(counts[vocab].sum() / counts.sum()):.3f} "
            "of the target's choices")
    baseline = None
    if config.baseline_head is not None:  # an earlier head on the same held-out positions
        baseline = evaluate(load_eagle_head(config.baseline_head, engine.model, fingerprint), batches, heldout,
                            engine.device)
        log(f"baseline head {config.baseline_head}: held-out top1 {baseline['top1']}")
    head = EagleHead(engine.model, vocab=vocab).to(engine.device)
    before = evaluate(head, batches, heldout, engine.device)
    log(f"{len(seqs)} sequences ({int(sum(map(len, seqs)))} tokens), {len(heldout)} held out; untrained top1 {before['top1']}")
    run = train(head, batches, train_pool, config, log)
    after = evaluate(head, batches, heldout, engine.device)
    log(f"trained {run['steps']} steps in {run['seconds']} s: held-out top1 {after['top1']}")
    report = {
        "command": command_line("train", "eagle"),
        "model": str(config.model), "data": {"prompts_from": config.prompts, "mixture": config.mixture,
                                           "exclude": config.exclude, "sequences": len(seqs),
                                           "tokens": int(sum(map(len, seqs))), "heldout_sequences": len(heldout),
                                           **selection},
        "config": asdict(config),
        "run": run, "heldout_before": before, "heldout": after, "torch": torch.__version__,
        **({"heldout_baseline": {"head": str(config.baseline_head), **baseline}} if baseline is not None else {}),
    }
    save_eagle_head(config.out, head, fingerprint, report)
    if traces is not None:
        head.eval()
        report["replay"] = {"file": str(config.replay), "cost": str(config.cost),
                            **replay_traces(engine, head, traces, cost, config.replay_max_new_tokens, EagleConfig())}
        save_eagle_head(config.out, head, fingerprint, report)
    print(json.dumps(report, indent=2))
    return report

"""Fine-tune a causal LM with semantic adaptive tokens (SDSAT) so that `--method sdsat` can use it.

    samctl train sdsat --model ../shared/models/<smollm2>.gguf --out runs/smollm2-sdsat \
        --data ../shared/data/codealpaca.json ../shared/data/gsm8k_train.jsonl --max-minutes 50 --threads 1

Trains on prompt + response sequences (--responses self: the model's own greedy answers, so the
SATs learn what greedy decoding will emit; data: the records' answers), with --blocks blocks of
--sat-count SATs at random anchors of the response (decode.sdsat.make_batch; standard tokens never
attend to SATs). The standard term (--keep-standard kl, the default) is KL(original || tuned)
against the frozen original top layers, which keeps the model's distribution where `ce` on its own
answers would sharpen it. The SAT token: --sat-token, else an unused special token, else a new
`<|sat|>`. Reported (stdout, sdsat_report.json): held-out standard loss, per-slot SAT accuracy and
mean accepted run, before and after.
"""
from __future__ import annotations

import copy
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from samctl.decode.sdsat import IGNORE, SatSettings, make_batch, sample_anchors, write_settings
from samctl.index.errors import UserError
from samctl.config import arg
from samctl.options import command_line, run_config_command
from samctl.models import Engine
from samctl.train.answers import own_answers, trainer_engine
from samctl.train.prompts import Prompt, read_prompts

NEW_SAT_TOKEN = "<|sat|>"


@dataclass(frozen=True)
class SdsatTrainConfig:
    """`samctl train sdsat`'s settings, recorded in the fine-tuned model's config and report."""

    model: str = arg(help="model folder or .gguf file to fine-tune")
    out: str = arg(help="folder for the fine-tuned model")
    data: tuple[str, ...] = arg(help="training prompts: any input samctl build reads (folder, Alpaca / GSM8K / "
                                "Spec-Bench JSON(L), Parquet, hf:NAME, -); each record's first user turn; one or more",
                                nargs="+", metavar="INPUT")
    field: tuple[str, ...] = arg((), "read prompts from this record field (repeatable)", multiple=True)
    num_prompts: int = arg(1200, "prompts read (training and held out)")
    heldout: int = arg(48, "prompts kept apart for the report")
    responses: str = arg("self", "self: the model's own greedy answers; data: the records' answers",
                         choices=("self", "data"))
    max_new_tokens: int = arg(128, "length of self-written answers")
    response_batch: int = arg(16, "answers written at once by the batched engine")
    seq_len: int = arg(320, "prompt + answer tokens kept per sequence")
    sat_count: int = arg(5, "k: SAT slots per block")
    sat_token: str = arg("", "token used as the SAT (default: chosen, see above)")
    blocks: int = arg(16, "SAT blocks per sequence")
    batch_size: int = arg(4, "sequences per optimizer step")
    lr: float = arg(1e-4, "peak learning rate")
    warmup: int = arg(20, "warm-up steps")
    sat_weight: float = arg(1.0, "weight of the SAT slots' cross-entropy")
    keep_standard: str = arg("kl", "standard-token term: KL to the original model or CE on the answers",
                             choices=("kl", "ce"))
    standard_weight: float = arg(1.0, "weight of the standard-token term")
    cache: str = arg("", "folder for the self-written answers (reused when model, prompts and settings match)")
    train_layers: int = arg(0, "train the top N layers only (0 = all)")
    freeze_sat_embedding: bool = arg(False, "keep the SAT token's embedding row as it is")
    max_steps: int = arg(1000, "optimizer steps")
    max_minutes: float = arg(55.0, "stop training after this long")
    device: str = arg("auto", "auto, cpu or cuda")
    threads: int = arg(0, "torch CPU threads (0 = torch's default)")
    seed: int = arg(0, "seed of the prompt order, the anchors and the initialization")
    no_chat: bool = arg(False, "do not apply the tokenizer's chat template")


# 1) data ---------------------------------------------------------------------------------------

def read_examples(config: SdsatTrainConfig) -> list[Prompt]:
    """The first user turn (and answer) of the records of --data, shuffled, --num-prompts + --heldout;
    with --responses data, only records with an answer."""
    prompts = [Prompt(p.kind, p.turns[:1], p.answer) for p in read_prompts(config.data, config.field)
               if p.turns and p.turns[0].strip()]
    if config.responses == "data":
        prompts = [p for p in prompts if p.answer.strip()]
    if not prompts:
        needs = "records with an answer (Alpaca output, GSM8K answer, prompt/completion)" \
            if config.responses == "data" else "records with a user turn (--field to pick one)"
        more = ", or --responses self to have the model answer" if config.responses == "data" else ""
        raise UserError(f"no training prompts in {' '.join(config.data)}: pass {needs}{more}")
    random.Random(config.seed).shuffle(prompts)
    return prompts[: config.num_prompts + config.heldout]


def choose_sat_token(engine: Engine, requested: str, texts: list[str]) -> tuple[int, str, bool]:
    """(id, text, added): the requested token, an unused special token, or a new one."""
    tok = engine.tokenizer
    if requested:
        ids = tok.convert_tokens_to_ids([requested])
        if ids[0] is None or ids[0] == tok.unk_token_id:
            raise UserError(f"--sat-token {requested!r} is not a token of this tokenizer: name one it has")
        return int(ids[0]), requested, False
    reserved = {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, *engine.eos_token_ids}
    template = str(getattr(tok, "chat_template", "") or "")
    sample = "".join(texts[:2000])
    for token_id, added in sorted(tok.added_tokens_decoder.items(), reverse=True):
        content = added.content
        if token_id not in reserved and content not in template and content not in sample:
            return int(token_id), content, False
    tok.add_special_tokens({"additional_special_tokens": [NEW_SAT_TOKEN]})
    new_id = tok.convert_tokens_to_ids(NEW_SAT_TOKEN)
    engine.model.resize_token_embeddings(len(tok), mean_resizing=True)
    return int(new_id), NEW_SAT_TOKEN, True


# 2) evaluation ---------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(model: torch.nn.Module, rows: list[tuple[np.ndarray, int]], k: int, sat_id: int, pad: int,
             device: torch.device, seed: int, blocks: int) -> dict:
    """Held-out standard-token loss, per-slot SAT accuracy and mean accepted run per anchor."""
    rng = np.random.default_rng(seed)
    dtype = next(model.parameters()).dtype
    model.eval()
    nll, count = 0.0, 0
    right = np.zeros(k)
    seen = np.zeros(k)
    runs: list[int] = []
    for seq, start in rows:
        anchors = sample_anchors(start, len(seq), blocks, rng)
        batch = make_batch([seq], [start], [anchors], k, sat_id, pad)
        logits = model(input_ids=batch.input_ids.to(device), position_ids=batch.position_ids.to(device),
                       attention_mask=batch.mask.to(device=device, dtype=dtype), use_cache=False).logits.float()[0]
        labels, sat = batch.labels[0].to(device), batch.is_sat[0].to(device)
        std = ~sat & (labels != IGNORE)
        nll += float(F.cross_entropy(logits[std], labels[std], reduction="sum"))
        count += int(std.sum())
        has = sat & (labels != IGNORE)
        hit = (logits.argmax(-1) == labels) & has
        slot = batch.slot[0].to(device)
        for j in range(1, k + 1):
            right[j - 1] += int((hit & (slot == j)).sum())
            seen[j - 1] += int((has & (slot == j)).sum())
        runs += [int(np.argmin(np.append(block, False))) for block in hit[sat].view(-1, k).cpu().numpy()]
    model.train()
    return {"standard_loss": nll / max(count, 1), "standard_tokens": count,
            "sat_accuracy": [round(float(r / s), 4) if s else None for r, s in zip(right, seen)],
            "mean_accepted_run": float(np.mean(runs)) if runs else 0.0}


# 3) training -----------------------------------------------------------------------------------

def trainable(model: torch.nn.Module, config: SdsatTrainConfig, sat_id: int, top: int) -> list[torch.nn.Parameter]:
    """Freeze all but the top `top` layers (+ final norm) and the SAT embedding row."""
    layers = model.model.layers
    model.requires_grad_(False)
    params = [p for layer in layers[len(layers) - top :] for p in layer.parameters()]
    params += list(model.model.norm.parameters())
    for p in params:
        p.requires_grad_(True)
    if not config.freeze_sat_embedding:
        emb = model.get_input_embeddings().weight.requires_grad_(True)
        params.append(emb)
        row = torch.zeros_like(emb)
        row[sat_id] = 1.0
        emb.register_hook(lambda grad: grad * row)  # only the SAT row learns (tied lm_head included)
    return params


class FrozenTop:
    """The original top layers, final norm and output matrix: the teacher of the `kl` term."""

    def __init__(self, model: torch.nn.Module, top: int) -> None:
        self.layers = copy.deepcopy(model.model.layers[len(model.model.layers) - top :]).requires_grad_(False)
        self.norm = copy.deepcopy(model.model.norm).requires_grad_(False)
        self.head = model.get_output_embeddings().weight.detach().clone()  # tied to the trained SAT row

    @torch.no_grad()
    def log_probs(self, hidden: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor,
                  rotary: torch.nn.Module) -> torch.Tensor:
        # hidden: [B, T, H] inputs of the top layers (standard part); mask [B, 1, T, T] -> [B, T, V]
        pe = rotary(hidden, position_ids)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=pe)
        return F.log_softmax(F.linear(self.norm(hidden), self.head).float(), -1)


def split_forward(model: torch.nn.Module, batch, top: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # -> logits [B, L, V] float32 of the model being trained, and the input of its top `top`
    # layers [B, L, H] (equal to the original model's there: the layers below are frozen)
    core = model.model
    ids, pos = batch.input_ids.to(device), batch.position_ids.to(device)
    mask = batch.mask.to(device=device, dtype=next(model.parameters()).dtype)
    hidden = core.embed_tokens(ids)
    pe = core.rotary_emb(hidden, pos)
    low = len(core.layers) - top
    base = hidden
    for i, layer in enumerate(core.layers):
        if i == low:
            base = hidden
        hidden = layer(hidden, attention_mask=mask, position_ids=pos, position_embeddings=pe)
    return model.lm_head(core.norm(hidden)).float(), base


def train(model, train_rows, config, sat_id: int, pad: int, device: torch.device) -> dict:
    layers = len(model.model.layers)
    top = layers if config.train_layers <= 0 else min(config.train_layers, layers)
    params = trainable(model, config, sat_id, top)
    teacher = FrozenTop(model, top) if config.keep_standard == "kl" else None
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    total = config.max_steps
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(config.warmup, 1)) * max(0.05, 1 - s / max(total, 1)))
    rng = np.random.default_rng(config.seed + 1)
    model.train()
    began = time.perf_counter()
    step, tokens, log = 0, 0, []
    while step < total and time.perf_counter() - began < config.max_minutes * 60:
        pick = rng.choice(len(train_rows), size=min(config.batch_size, len(train_rows)), replace=False)
        seqs = [train_rows[i][0] for i in pick]
        starts = [train_rows[i][1] for i in pick]
        anchors = [sample_anchors(s, len(q), config.blocks, rng) for q, s in zip(seqs, starts)]
        batch = make_batch(seqs, starts, anchors, config.sat_count, sat_id, pad)
        logits, base = split_forward(model, batch, top, device)
        labels = batch.labels.to(device)
        sat = batch.is_sat.to(device)
        sat_loss = F.cross_entropy(logits[sat], labels[sat], ignore_index=IGNORE)
        if teacher is None:
            std_loss = F.cross_entropy(logits[~sat], labels[~sat], ignore_index=IGNORE)
        else:  # KL(original || tuned) at the standard positions that have a next token in the answer
            width = max(len(q) for q in seqs)
            std = labels[:, :width] != IGNORE
            mask = batch.mask[:, :, :width, :width].to(device=device, dtype=base.dtype)
            original = teacher.log_probs(base[:, :width].detach(), mask, batch.position_ids[:, :width].to(device),
                                         model.model.rotary_emb)[std]
            std_loss = F.kl_div(F.log_softmax(logits[:, :width][std], -1), original, log_target=True,
                                reduction="batchmean")
        loss = config.standard_weight * std_loss + config.sat_weight * sat_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        step += 1
        tokens += int(batch.input_ids.numel())
        if step % 10 == 0 or step == 1:
            elapsed = time.perf_counter() - began
            log.append({"step": step, "std_loss": round(std_loss.item(), 4), "sat_loss": round(sat_loss.item(), 4),
                        "seconds": round(elapsed, 1)})
            print(f"step {step}: standard {config.keep_standard} {std_loss.item():.4f}, sat {sat_loss.item():.3f}, "
                  f"{tokens / elapsed:.0f} tok/s", file=sys.stderr, flush=True)
    return {"steps": step, "tokens": tokens, "seconds": round(time.perf_counter() - began, 1), "log": log}


# 4) main ---------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict:
    """`samctl train sdsat ARGS...`: the report, also written to sdsat_report.json in --out."""
    return run_config_command(argv, "sdsat", SdsatTrainConfig, run, __doc__.split("\n\n")[0])


def run(config: SdsatTrainConfig) -> dict:
    began = time.perf_counter()
    engine = trainer_engine(config, config.model)
    model, device = engine.model, engine.device
    chat = not config.no_chat and bool(getattr(engine.tokenizer, "chat_template", None))

    prompts = read_examples(config)
    eos = list(engine.eos_token_ids)
    # [prompt ids, answer ids] by prompt index: the records' answers and, with --responses self, the model's
    data_answers = {i: [engine.encode(p.turns[0], chat)[: config.seq_len // 2],
                        engine.tokenizer(p.answer, add_special_tokens=False)["input_ids"] + eos[:1]]
                    for i, p in enumerate(prompts) if p.answer.strip()}
    answers = data_answers
    if config.responses == "self":  # prompts longer than --seq-len / 2 tokens are left out
        answers = {a.prompt: [a.prompt_ids, a.output_ids] for a in own_answers(
            engine, prompts, chat, cache=config.cache, name="sdsat", max_new_tokens=config.max_new_tokens,
            max_prompt_tokens=config.seq_len // 2, batch_size=config.response_batch)}
    sat_id, sat_text, added = choose_sat_token(engine, config.sat_token, [p.turns[0] + p.answer for p in prompts])

    def rows(indices, kind):  # (sequence, prompt length) of each answered prompt, 2+ answer tokens kept
        out = [(np.asarray((kind[i][0] + kind[i][1])[: config.seq_len], dtype=np.int64), len(kind[i][0]))
               for i in indices if i in kind]
        return [(seq, start) for seq, start in out if len(seq) - start >= 2]

    held = range(config.heldout)
    train_rows = rows(range(config.heldout, len(prompts)), answers)
    held_rows = rows(held, answers)
    if not train_rows:
        raise UserError(f"no training sequences: {len(prompts)} prompts, {config.heldout} held out, none left with an "
                        "answer of 2+ tokens: give more --data or --num-prompts, or a larger --seq-len")
    pad = eos[0] if eos else 0
    k = config.sat_count
    report = {"model": config.model, "out": config.out, "command": command_line("train", "sdsat"),
              "config": asdict(config), "sat_token": sat_text, "sat_token_id": sat_id, "added_to_vocab": added,
              "train_sequences": len(train_rows), "heldout_sequences": len(held_rows), "responses": config.responses,
              "device": str(device), "threads": torch.get_num_threads()}

    def evaluations(when: str) -> None:  # on the training kind of answer, and on the files' answers too
        report[when] = evaluate(model, held_rows, k, sat_id, pad, device, config.seed, config.blocks)
        if config.responses == "self" and data_answers:
            report[f"{when}_data_answers"] = evaluate(model, rows(held, data_answers), k, sat_id, pad, device,
                                                      config.seed, config.blocks)

    evaluations("before")
    report["training"] = train(model, train_rows, config, sat_id, pad, device)
    model.requires_grad_(False)
    evaluations("after")
    before, after = report["before"]["standard_loss"], report["after"]["standard_loss"]
    report["standard_loss_change"] = round(after / before - 1.0, 4) if before else math.nan
    report["total_seconds"] = round(time.perf_counter() - began, 1)

    settings = SatSettings(sat_id, k, sat_text, added)
    record = {key: report[key] for key in ("command", "responses", "train_sequences", "device")}
    record.update(steps=report["training"]["steps"], sat_weight=config.sat_weight, keep_standard=config.keep_standard,
                  standard_weight=config.standard_weight, train_layers=config.train_layers,
                  blocks=config.blocks, lr=config.lr)
    write_settings(model.config, settings, record)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    engine.tokenizer.save_pretrained(out)
    (out / "sdsat_report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({key: v for key, v in report.items() if key != "training"}, indent=1))
    return report

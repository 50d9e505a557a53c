"""SpecDec++'s acceptance-prediction head (Huang, Guo & Wang 2024), and how it is trained.

The head reads the draft model's post-norm last hidden state at a draft token and predicts the
probability that the target accepts that token:

    ResBlock(x) = x + SiLU(W x + b)          Head = [ResBlock] x L  ->  Linear(h, 2),  class 1 = accept

With `shared_blocks` (the reference's `[ResBlock(h)] * L`, and the default) the L blocks are one
module applied L times, so a head stores one block.

Training data (`collect_examples`): the target's response is fed teacher-forced to both models; at
every response position the draft samples z ~ q (temperature 1, unwarped), labelled min(1, p(z)/q(z))
as in the paper (with `greedy`: z = argmax q, labelled 1[argmax p = z], what greedy decoding accepts).
The draft then reads prompt + the drafted tokens, a `mixing_ratio` share of them replaced by the
target's (unlabelled), and its last hidden state at each drafted token is the head's input. The
draft stays frozen, so the head trains on these features alone (`train_head`) with the loss

    loss = sum[w (1-y) (-log(1-P)) + y (-log P)] / (w sum(1-y) + sum y),   w = weight_mismatch

Knows tensors and models; never text, files or the decode loop.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from samctl.index.errors import ConfigError, UserError


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    num_blocks: int = 3
    shared_blocks: bool = True

    def __post_init__(self) -> None:
        if self.hidden_size < 1 or self.num_blocks < 0:
            raise UserError(f"acceptance head needs hidden_size >= 1 and num_blocks >= 0, got {self}")


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class AcceptanceHead(nn.Module):
    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config
        count = min(1, config.num_blocks) if config.shared_blocks else config.num_blocks
        self.blocks = nn.ModuleList(ResBlock(config.hidden_size) for _ in range(count))
        self.out = nn.Linear(config.hidden_size, 2)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [..., H] float32 -> logits [..., 2] (class 1 = accept)
        x = hidden
        for i in range(self.config.num_blocks):
            x = self.blocks[0 if self.config.shared_blocks else i](x)
        return self.out(x)

    @torch.inference_mode()
    def accept_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [..., H] any float dtype -> [...] float32 P(accept), computed in float32
        return torch.softmax(self(hidden.float()), dim=-1)[..., 1]


@dataclass(frozen=True)
class TrainConfig:
    mixing_ratio: float = 0.15  # share of drafted positions replaced by target tokens (no label)
    weight_mismatch: float = 6.0  # loss weight of the "rejected" class
    steps: int = 2000  # optimizer steps over minibatches drawn epoch by epoch
    batch_size: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.mixing_ratio < 1.0:
            raise ConfigError("{mixing_ratio} must be in [0, 1), got {value}", value=self.mixing_ratio)
        if self.weight_mismatch <= 0 or self.steps < 1 or self.batch_size < 1 or self.lr <= 0:
            raise UserError(f"invalid head training settings {self}: weight, steps, batch and lr must be > 0")


@dataclass
class Examples:
    features: torch.Tensor  # [N, H] float32, the draft's last hidden state at each drafted token
    labels: torch.Tensor  # [N] float32, min(1, p/q) of that token

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @classmethod
    def concat(cls, parts: list["Examples"]) -> "Examples":
        if not parts:
            return cls(torch.zeros(0, 0), torch.zeros(0))
        return cls(torch.cat([p.features for p in parts]), torch.cat([p.labels for p in parts]))


@torch.inference_mode()
def collect_examples(target: nn.Module, draft: nn.Module, prompt_ids: list[int], response_ids: list[int],
                     mixing_ratio: float, generator: torch.Generator, greedy: bool = False) -> Examples:
    """Head training examples from one (prompt, target response) pair (the module docstring's data)."""
    device = next(draft.parameters()).device
    n, m = len(prompt_ids), len(response_ids)
    if n == 0 or m == 0:
        return Examples(torch.zeros(0, int(draft.config.hidden_size)), torch.zeros(0))
    joint = torch.tensor([prompt_ids + response_ids], dtype=torch.int64, device=device)
    vocab = min(int(target.config.vocab_size), int(draft.config.vocab_size))
    # Logits at positions n-1 .. n+m-2 predict the m response tokens.
    p = torch.softmax(target(input_ids=joint).logits[0, n - 1 : n + m - 1].float(), dim=-1)
    q = torch.softmax(draft(input_ids=joint).logits[0, n - 1 : n + m - 1, :vocab].float(), dim=-1)
    if greedy:
        z = q.argmax(-1)  # [m] drafted tokens
        labels = (p.argmax(-1) == z).float()
    else:
        z = torch.multinomial(q.cpu(), 1, generator=generator).squeeze(-1).to(device)
        p_z = p.gather(-1, z[:, None]).squeeze(-1)
        q_z = q.gather(-1, z[:, None]).squeeze(-1)
        labels = torch.clamp(p_z / q_z, max=1.0)
    mixed = torch.rand(m, generator=generator).to(device) < mixing_ratio
    tokens = torch.where(mixed, joint[0, n:], z)
    features_in = torch.cat((joint[0, :n], tokens))[None]
    hidden = draft(input_ids=features_in, output_hidden_states=True).hidden_states[-1][0, n:].float()
    keep = ~mixed
    return Examples(hidden[keep].cpu(), labels[keep].cpu())


def weighted_bce(logits: torch.Tensor, labels: torch.Tensor, weight_mismatch: float) -> torch.Tensor:
    # logits: [N, 2]; labels: [N] soft P(accept) in [0, 1] -> scalar loss
    log_prob = torch.log_softmax(logits.float(), dim=-1)
    reject = 1.0 - labels
    total = -(weight_mismatch * reject * log_prob[:, 0] + labels * log_prob[:, 1]).sum()
    return total / (weight_mismatch * reject.sum() + labels.sum()).clamp_min(1e-12)


@torch.inference_mode()
def evaluate_head(head: AcceptanceHead, examples: Examples, weight_mismatch: float) -> float:
    if len(examples) == 0:
        return float("nan")
    return float(weighted_bce(head(examples.features), examples.labels, weight_mismatch))


def train_head(head: AcceptanceHead, examples: Examples, config: TrainConfig,
               valid: Examples | None = None) -> list[float]:
    """AdamW with a cosine schedule on the fixed features. With `valid`, the head ends with the
    weights of the pass that scored best on it (small data overfits fast). Returns the mean
    training loss of each pass over the examples."""
    if len(examples) == 0:
        raise UserError("no training examples: give more prompts or longer responses")
    generator = torch.Generator().manual_seed(config.seed)
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=config.steps)
    history: list[float] = []
    best = (evaluate_head(head, valid, config.weight_mismatch), copy.deepcopy(head.state_dict())) if valid else None
    step = 0
    while step < config.steps:
        head.train()
        order = torch.randperm(len(examples), generator=generator)
        total, count = 0.0, 0
        for start in range(0, len(order), config.batch_size):
            if step == config.steps:
                break
            batch = order[start : start + config.batch_size]
            loss = weighted_bce(head(examples.features[batch]), examples.labels[batch], config.weight_mismatch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            step += 1
            total += float(loss.detach()) * len(batch)
            count += len(batch)
        history.append(total / count)
        head.eval()
        if best is not None:
            score = evaluate_head(head, valid, config.weight_mismatch)
            if score < best[0]:
                best = (score, copy.deepcopy(head.state_dict()))
    if best is not None:
        head.load_state_dict(best[1])
    head.eval()
    return history

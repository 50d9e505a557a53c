"""The settings of every drafter, as frozen dataclasses validated on construction.

They live apart from the drafters so that the command line can build its options from their
field metadata (`cli`, `help`, `choices`, `metavar`, `type`, `cpu_default`, `pair`; samctl/options.py)
without importing torch or numba: `samctl generate --help` and usage errors stay fast. Each
drafter module re-exports its own section.
"""
from __future__ import annotations

import math
from dataclasses import Field, asdict, dataclass, field, fields

from samctl.index.errors import ConfigError, UserError

# How the target's forward runs (decode/engine/native.py): native where the architecture is
# supported (auto) or required, else transformers' modules (hf)
BACKENDS = ("auto", "hf", "native")

# Token Recycle's rank acceptance model behind the default template: the r-th candidate of a token
# is the target's next choice with about this probability (measured shape from the paper's Vicuna
# runs, rounded); RecycleConfig.k is at most its length.
RECYCLE_RANK_ACCEPT = (0.55, 0.14, 0.07, 0.045, 0.03, 0.022, 0.016, 0.012)


# Upper bounds of the size settings: far above any useful value, low enough that what they size
# (draft trees verified in one forward, buffers preallocated from them) fits in memory.
TREE_MAX = 1024  # draft nodes per step
LENGTH_MAX = 256  # draft lengths and depths, n-gram sizes, windows, children per node
MEMORY_MAX = 1 << 20  # earlier outputs remembered


def setting_name(f: Field) -> str:
    """The parsed option's key: click's name for the (first) flag."""
    return f.metadata["cli"].split("/")[0].lstrip("-").replace("-", "_")


def _within_bounds(config: object) -> None:
    """Refuse a setting above its field's `max` or below its `min` (metadata), fields in declaration order."""
    for f in fields(config):
        high, value = f.metadata.get("max"), getattr(config, f.name)
        if high is not None and isinstance(value, int) and value > high:
            raise ConfigError(f"{{{setting_name(f)}}} must be at most {high}, got {{value}}: pass a value up to {high} "
                              "(a larger one costs memory and time, and drafts no better)", value=value)
        if "min" in f.metadata:
            low = f.metadata["min"]
            _need(value >= low, f"{{{setting_name(f)}}} must be >= {low}, got {{value}}", value)


def _need(ok: bool, template: str, value: object) -> None:
    """A setting's check: the ConfigError names the setting by its Python name (`max_nodes`)."""
    if not ok:
        raise ConfigError(template, value=value)


@dataclass(frozen=True)
class AdaptiveConfig:
    max_nodes: int = field(default=64, metadata={
        "max": TREE_MAX, "min": 0, "cli": "--max-nodes", "help": "adaptive: most draft nodes per step (the cost curve usually picks fewer)."})
    min_prob: float = field(default=0.035, metadata={
        "cli": "--min-prob", "help": "adaptive: drop draft nodes less likely than this to be accepted."})
    memory: int = field(default=1024, metadata={
        "max": MEMORY_MAX, "min": 0, "cli": "--memory", "help": "adaptive: earlier outputs remembered across requests (0: off)."})
    memory_tokens: int = 4_000_000  # the memory's token budget; the oldest requests go first
    recycle: bool = field(default=True, metadata={
        "cli": "--recycle/--no-recycle", "help": "adaptive: Token Recycle candidates where retrieval has none."})
    prior_weight: float = 4.0  # pseudo-trials behind each cell's prior estimate
    max_trials: float = 4000.0  # a cell's evidence is rescaled at this size, so it keeps adapting
    width: int = 3  # children expanded per node and per match level
    levels: int = 6  # match lengths (suffix-link levels) that propose first tokens
    # A large store's short contexts have thousands of continuations, each a cost to rank and
    # rarely right: the store proposes from fewer, longer matches.
    static_levels: int = 2
    static_min_length: int = 3
    recycle_k: int = 8  # successors kept per token

    def __post_init__(self) -> None:
        _within_bounds(self)
        _need(0.0 <= self.min_prob < 1.0, "{min_prob} must be in [0, 1), got {value}", self.min_prob)
        if self.memory_tokens < 0 or self.width < 1 or self.levels < 1 or self.recycle_k < 1 or self.prior_weight <= 0:
            raise UserError(f"invalid adaptive settings {asdict(self)}")


@dataclass(frozen=True)
class SamConfig:
    # SAM-Decoding's len_threshold
    dyn_threshold: int = field(default=5, metadata={
        "max": LENGTH_MAX, "min": 1, "cli": "--sam-threshold", "help": "sam: dynamic-automaton match length that triggers a retrieval draft."})
    # len_bias: the static match must reach dyn_threshold + static_bias
    static_bias: int = field(default=5, metadata={
        "max": LENGTH_MAX, "min": 0, "cli": "--static-bias", "help": "sam: extra match length the static store needs (it triggers at threshold "
                                        "+ bias, capped at an n-gram store's longest context)."})
    max_draft: int = field(default=39, metadata={"max": LENGTH_MAX, "min": 1, "cli": "--max-draft", "help": "sam: longest retrieval draft."})  # n_predicts 40 - t0
    alpha: float = field(default=4.0, metadata={
        "cli": "--sam-alpha", "help": "sam: draft length grows as alpha x match length, up to --max-draft."})
    occurrence: str = field(default="first", metadata={
        "cli": "--occurrence", "choices": ("first", "latest"),
        "help": "sam: which earlier occurrence retrieval drafts continue."})

    def __post_init__(self) -> None:
        _within_bounds(self)
        _need(math.isfinite(self.alpha) and self.alpha > 0, "{sam_alpha} must be a finite number > 0, got {value}",
              self.alpha)
        _need(self.occurrence in ("first", "latest"), "{occurrence} must be first or latest, got {value!r}",
              self.occurrence)


@dataclass(frozen=True)
class PldConfig:
    # transformers' max_matching_ngram_size (its default is 2; Spec-Bench uses 3)
    max_ngram: int = field(default=3, metadata={"max": LENGTH_MAX, "min": 1, "cli": "--pld-ngram", "help": "pld: longest n-gram matched."})
    # transformers' prompt_lookup_num_tokens
    num_draft: int = field(default=10, metadata={"max": LENGTH_MAX, "min": 1, "cli": "--pld-tokens", "help": "pld: draft tokens."})

    def __post_init__(self) -> None:
        _within_bounds(self)


@dataclass(frozen=True)
class RecycleConfig:
    k: int = 8  # successors kept per token
    # template size, root excluded (the official "2.2.2" tree has 80 + root); on a CPU a verify
    # costs about linearly in its tokens, so the GPU-sized tree costs more than it saves there
    nodes: int = field(default=80, metadata={
        "max": TREE_MAX, "min": 1, "cli": "--recycle-nodes", "cpu_default": 16,
        "help": "recycle, sam+recycle: draft tree size [default: 80; 16 on a CPU]."})
    max_depth: int = 6

    def __post_init__(self) -> None:
        _within_bounds(self)
        if not 1 <= self.k <= len(RECYCLE_RANK_ACCEPT) or self.nodes < 1 or self.max_depth < 1:
            raise UserError(f"Token Recycle needs 1 <= k <= {len(RECYCLE_RANK_ACCEPT)}, nodes >= 1, depth >= 1; got {self}")


@dataclass(frozen=True)
class RestConfig:
    max_span: int = 16  # longest context suffix tried (REST max_token_span)
    min_span: int = 2  # shortest suffix that may draft
    # draft tokens, root excluded (REST num_draft)
    num_nodes: int = field(default=64, metadata={"max": TREE_MAX, "min": 1, "cli": "--rest-nodes", "help": "rest: draft tree size."})
    # continuation length counted per occurrence
    max_depth: int = field(default=10, metadata={"max": LENGTH_MAX, "min": 1, "cli": "--rest-depth", "help": "rest: deepest draft token."})

    def __post_init__(self) -> None:
        _within_bounds(self)
        if not 1 <= self.min_span <= self.max_span or self.num_nodes < 1 or self.max_depth < 1:
            raise UserError(f"REST needs 1 <= min_span <= max_span, num_nodes >= 1, max_depth >= 1; got {self}")


@dataclass(frozen=True)
class DraftConfig:
    gamma: int = field(default=4, metadata={  # tokens per step for `sd` (and for `sam+draft`'s fallback)
        "cli": "--gamma", "help": "sd, sam+draft, ouroboros: draft tokens per step."})

    def __post_init__(self) -> None:
        _need(1 <= self.gamma <= LENGTH_MAX, f"{{gamma}} must be in [1, {LENGTH_MAX}], got {{value}}", self.gamma)


@dataclass(frozen=True)
class SpecDecConfig:
    stop_threshold: float = field(default=0.3, metadata={
        "cli": "--stop-threshold", "help": "specdec++: stop drafting once the predicted P(some draft token is rejected) exceeds this."})
    min_draft: int = field(default=2, metadata={  # one option for the pair
        "cli": "--bounds", "pair": "max_draft", "metavar": "MIN MAX", "help": "specdec++: inclusive bounds on the draft length."})
    max_draft: int = 20

    def __post_init__(self) -> None:
        _need(0.0 <= self.stop_threshold <= 1.0, "{stop_threshold} must be in [0, 1], got {value}", self.stop_threshold)
        if not 1 <= self.min_draft <= self.max_draft <= LENGTH_MAX:
            raise ConfigError(f"{{bounds}} (MIN, MAX) need 1 <= MIN <= MAX <= {LENGTH_MAX}, got {{low}} {{high}}",
                              low=self.min_draft, high=self.max_draft)


@dataclass(frozen=True)
class LookaheadConfig:
    # The defaults are the MT-Bench script's (N 5, W = G 15) for a GPU, where a wide verify costs
    # little; on a CPU a verify of k tokens costs about k times more (BENCHMARKS.md), so the CLI
    # uses the small `cpu_default` there.
    ngram: int = field(default=5, metadata={
        "max": LENGTH_MAX, "min": 2, "cli": "--la-ngram", "cpu_default": 4,
        "help": "lookahead: N, the n-gram size (N-1 window levels, guesses of N-1 tokens) [default: 5; 4 on a CPU]."})
    window: int = field(default=15, metadata={
        "max": LENGTH_MAX, "min": 0, "cli": "--la-window", "cpu_default": 2,
        "help": "lookahead: W, the window's columns (0: no window, the pool alone) [default: 15; 2 on a CPU]."})
    guesses: int = field(default=15, metadata={
        "max": LENGTH_MAX, "min": 0, "cli": "--la-guesses", "cpu_default": 4,
        "help": "lookahead: G, pool tuples per key and guesses verified per step [default: 15; 4 on a CPU]."})
    pool_text: bool = field(default=True, metadata={
        "cli": "--la-pool-text/--no-la-pool-text",
        "help": "lookahead, ouroboros: the pool also takes the n-grams of the prompt and the output."})
    seed: int = 0  # the window's seeding generator
    memory: int = 1024  # earlier outputs kept for --memory-save (the pool itself is bounded by G per key)

    def __post_init__(self) -> None:
        _within_bounds(self)
        if self.memory < 0:
            raise UserError(f"invalid lookahead settings {asdict(self)}")


@dataclass(frozen=True)
class OuroborosConfig:
    # Section 9's benchmark settings (N 6, W = G 15) for a GPU; the CLI's CPU values are smaller
    # (the draft's wide lookahead forward costs more than it returns there, BENCHMARKS.md).
    ngram: int = field(default=6, metadata={
        "max": LENGTH_MAX, "min": 2, "cli": "--ouro-ngram", "cpu_default": 4, "help": "ouroboros: N of the draft's lookahead [default: 6; 4 on a CPU]."})
    window: int = field(default=15, metadata={
        "max": LENGTH_MAX, "min": 1, "cli": "--ouro-window", "cpu_default": 4,
        "help": "ouroboros: W = G, the draft's window columns and pool tuples per key [default: 15; 4 on a CPU]."})
    topk: int = field(default=3, metadata={"max": LENGTH_MAX, "min": 0, "cli": "--ouro-topk", "help": "ouroboros: pool suffixes the target verifies."})
    seed: int = 0
    memory: int = 1024

    def __post_init__(self) -> None:
        _within_bounds(self)
        if self.memory < 0:
            raise UserError(f"invalid ouroboros settings {asdict(self)}")


@dataclass(frozen=True)
class SdsatConfig:
    sat_count: int = field(default=0, metadata={
        "max": LENGTH_MAX, "min": 0, "cli": "--sat-count", "help": "SAT slots per step (sdsat; default 0 = the count the model was trained with)"})

    def __post_init__(self) -> None:
        _within_bounds(self)


@dataclass(frozen=True)
class EagleConfig:
    top_k: int = field(default=8, metadata={
        "max": LENGTH_MAX, "min": 1, "cli": "--eagle-top-k", "help": "eagle, sam+eagle, adaptive+eagle: children per expanded node and frontier width."})
    depth: int = field(default=5, metadata={
        "max": LENGTH_MAX, "min": 0, "cli": "--eagle-depth", "help": "eagle, sam+eagle, adaptive+eagle: frontier expansions per step (levels up to depth + 1)."})
    max_nodes: int = field(default=60, metadata={
        "max": TREE_MAX, "min": 0, "cli": "--eagle-nodes", "help": "eagle, sam+eagle, adaptive+eagle: most draft nodes per step (the cost curve usually picks fewer)."})
    min_prob: float = field(default=0.02, metadata={
        "cli": "--eagle-min-prob", "help": "eagle, sam+eagle, adaptive+eagle (CPU): stop expanding once no frontier path is this likely."})
    prior_weight: float = 8.0  # pseudo-observations behind the calibration's prior scale 1

    def __post_init__(self) -> None:
        _within_bounds(self)
        _need(0.0 <= self.min_prob < 1.0, "{eagle_min_prob} must be in [0, 1), got {value}", self.min_prob)
        if self.prior_weight <= 0:
            raise UserError(f"invalid eagle settings {asdict(self)}")


@dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 means greedy (argmax); top_k 0 and top_p 1.0 mean off."""

    temperature: float = field(default=0.0, metadata={"cli": "--temperature", "help": "0 = greedy."})
    top_k: int = field(default=0, metadata={"cli": "--top-k", "help": "0 = off."})
    top_p: float = field(default=1.0, metadata={"cli": "--top-p", "help": "1.0 = off."})
    seed: int | None = field(default=None, metadata={"cli": "--seed", "type": int, "help": "Sampling seed (default: random)."})

    def __post_init__(self) -> None:
        _need(math.isfinite(self.temperature) and self.temperature >= 0,
              "{temperature} must be a finite number >= 0 (0 = greedy), got {value}", self.temperature)
        _need(self.top_k >= 0, "{top_k} must be >= 0, got {value}", self.top_k)
        _need(0.0 < self.top_p <= 1.0, "{top_p} must be in (0, 1], got {value}", self.top_p)  # also refuses nan

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

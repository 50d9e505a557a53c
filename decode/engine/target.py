"""The target model behind one interface: prefill, verify a draft tree, keep the accepted path.

Works with any Hugging Face causal LM that takes a 4D additive attention mask, explicit
`position_ids` and a transformers `Cache` (Llama, Qwen2, Mistral, GPT-NeoX families), under the
sdpa or eager attention paths; others (flash, flex) ignore a 4D mask, so the model is switched to
sdpa or refused. On CUDA, grouped-query models switch to the same sdpa with head groups folded
into query rows (decode.engine.attention), so a tree verify copies no K/V per head. Sliding-window
models work while prompt + output fit in the window, which then caps the context.

The engine owns a preallocated KV cache (`decode.engine.kv_cache`): no per-step concatenation, and an
accepted tree path is compacted with one gather over all layers. Nothing here reads a device
value on the host: inputs go host -> device through pinned memory without waiting, and the tree
mask is edited on the device where only the [q, q] block of the verified tokens changes.
With `capture_hidden(True)` (EAGLE's head reads them) every prefill and verify also leaves the
target's last hidden state, post-final-norm (the lm_head input), in `hidden`: [q, H] on the device,
taken by a forward hook on the final norm of the same forward, so no second forward and no host
sync; without it the forward is untouched. Knows nothing of drafters or acceptance rules.
"""
from __future__ import annotations

import numpy as np
import torch

from samctl.decode.engine.attention import NAME as FOLDED, ROWWISE, use_folded_gqa
from samctl.decode.engine.kv_cache import StaticKVCache, with_cache
from samctl.decode.engine.native import native_of
from samctl.decode.engine.transfer import to_device
from samctl.decode.tree import DraftTree, ancestor_matrix
from samctl.index.errors import UserError

# attention paths that apply a custom 4D additive mask (decode/engine/attention.py: FOLDED, ROWWISE)
MASK_ATTENTION = ("sdpa", "eager", FOLDED, ROWWISE)
VERIFY_SLACK = 256  # cache room reserved beyond prompt + output for the largest verify block


class TargetModel:
    """Holds the model and its KV cache for one sequence at a time (batch size 1)."""

    def __init__(self, model: torch.nn.Module, fold_groups: bool | None = None) -> None:
        # fold_groups: grouped-query attention folds head groups into query rows instead of
        # copying K/V per head (decode.engine.attention); default: on CUDA
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        config = model.config
        _require_mask_attention(model)
        if fold_groups if fold_groups is not None else self.device.type == "cuda":
            use_folded_gqa(model)
        self.max_positions = int(getattr(config, "max_position_embeddings", 1 << 30) or (1 << 30))
        self.context_note = "the model's context"
        window = _sliding_window(config)
        if window is not None and window < self.max_positions:
            # Beyond the window the model must stop seeing old tokens, which this engine's
            # full-context mask does not do: cap the context instead of computing wrong logits.
            self.max_positions = window
            self.context_note = (f"{getattr(config, 'model_type', 'this model')} uses sliding-window attention, "
                                 "which samctl supports only within the window; the window")
        self.cache = StaticKVCache(int(config.num_hidden_layers), self.dtype, self.device)
        self.cached = 0  # tokens whose K/V are in the cache and committed
        self._mask = torch.zeros(0, 0, dtype=self.dtype, device=self.device)
        self._mask_block = (0, 0)  # (q, past) of the tree block written into _mask last
        self._blocked = torch.finfo(self.dtype).min
        self.graphs = None  # decode.engine.graphs.VerifyGraphs, set by enable_cuda_graphs on CUDA only
        self.eager_fallbacks = 0  # verifies run eagerly while graphs were on (too wide, or capture failed)
        self.hidden: torch.Tensor | None = None  # [q, H] of the last forward, with capture_hidden only
        self._hidden_hook = None
        self._wants_hidden = False
        self.native = native_of(model)  # the native forward (decode/engine/native.py), or None: transformers'

    def capture_hidden(self, enabled: bool) -> None:
        """Keep the last hidden state of every prefill and verify position in `hidden`."""
        if enabled == self._wants_hidden:
            return
        self._wants_hidden = enabled
        if not enabled:
            if self._hidden_hook is not None:
                self._hidden_hook.remove()
            self._hidden_hook, self.hidden = None, None
            return
        if self.native is None:  # the native forward returns them itself
            self._hidden_hook = final_norm(self.model).register_forward_hook(self._keep_hidden)
        # CUDA graphs keep the final norm's output in every capture: nothing to recapture here

    @property
    def wants_hidden(self) -> bool:
        return self._wants_hidden

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None,
                last: int = 0, upto: int | None = None) -> torch.Tensor:
        # input_ids, position_ids: [1, q] int64 on device; mask: [1, 1, q, kv] additive or None
        # (causal); last: logits of the last `last` inputs only (0: all); upto: a host bound on
        # the positions -> logits [q or last, V]. The one place an eager forward of either
        # backend runs.
        if self.native is not None:
            logits, hidden = self.native(input_ids, position_ids, mask, self.cache, last, upto)
            if self._wants_hidden:
                self.hidden = hidden
            return logits
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                         **with_cache(self.model, self.cache), use_cache=True, logits_to_keep=last)
        return out.logits[0]

    def _keep_hidden(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        # output: [1, q, H] the final norm's output = the lm_head input at every input position
        self.hidden = output[0]

    @torch.inference_mode()
    def prefill(self, prompt_ids: torch.Tensor, all_logits: bool = False, reserve: int = 0) -> torch.Tensor:
        # prompt_ids: [n] int64 on device -> logits [n, V] of every prompt position if all_logits,
        # else [1, V] at the last one (a [n, V] float32 block is 150 MB for 769 tokens of a 49k vocab)
        n = int(prompt_ids.shape[0])
        self.cache.set_length(0)
        self.cache.reserve(max(reserve, n) + VERIFY_SLACK)
        self._reset_mask()
        logits = self.forward(prompt_ids[None], torch.arange(n, device=self.device)[None], None, 0 if all_logits else 1, n)
        self.cached = n
        return logits

    def verify_input(self, t0: int, tree: DraftTree) -> torch.Tensor:
        return verify_input(t0, tree, self.device)

    @torch.inference_mode()
    def verify(self, input_ids: torch.Tensor, tree: DraftTree) -> torch.Tensor:
        # input_ids: [q] int64 = [t0, nodes...] on device (placeholders -1 are fed as 0)
        # -> logits [q, V]. Appends q entries to the cache; `keep` must follow before the next call.
        q = int(input_ids.shape[0])
        past = self.cached
        self.cache.reserve(past + q)
        if tree.is_chain:
            position_ids = torch.arange(past, past + q, device=self.device)[None]
        else:
            position_ids = to_device(past + np.concatenate(([0], tree.depths())).astype(np.int64), self.device)[None]
        if self.graphs is not None:  # CUDA only (decode.engine.graphs)
            logits = self.graphs.run(input_ids.clamp_min(0), position_ids, tree, past) if self.graphs.covers(q) else None
            if logits is not None:
                return logits
            self.eager_fallbacks += 1
        # A chain needs no mask: the model's own causal mask is exactly the chain's tree mask.
        mask = None if tree.is_chain else self._tree_mask(tree.parents, past)
        logits = self.forward(input_ids.clamp_min(0)[None], position_ids, mask, upto=past + q)
        assert self.cache.get_seq_length() == past + q, (self.cache.get_seq_length(), past, q)
        return logits

    @torch.inference_mode()
    def peek(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [q] int64 on device, a chain after the committed tokens -> logits [q, V].
        # Runs the chain without committing it: the cache length returns to the committed one,
        # so the next verify overwrites these entries (SDSAT's draft forward, "crop the SAT K/V").
        q = int(input_ids.shape[0])
        past = self.cached
        self.cache.reserve(past + q)
        logits = self.forward(input_ids[None], torch.arange(past, past + q, device=self.device)[None], None, upto=past + q)
        self.cache.set_length(past)
        return logits

    @torch.inference_mode()
    def keep(self, path: np.ndarray) -> None:
        # path: [a+1] input indices of the accepted path of the last verify, root (0) first.
        # Chain-shaped paths (0, 1, ..., a) only shorten the cache; others gather the accepted
        # K/V entries to the front of the verified block. RoPE stays right because every entry
        # was computed at its true position.
        past = self.cached
        n = len(path)
        if n > 1 and path[-1] != n - 1:  # paths increase, so this is "not 0..a"
            self.cache.compact(past, to_device(past + np.asarray(path, dtype=np.int64), self.device))
        else:
            self.cache.set_length(past + n)
        self.cached = past + n

    def truncate(self, n: int) -> None:
        """Keep the first n committed tokens' K/V (a drafter's engine rolling back its own text)."""
        assert 0 <= n <= self.cached, (n, self.cached)
        self.cache.set_length(n)
        self.cached = n

    def _reset_mask(self) -> None:
        q, past = self._mask_block
        if q:
            self._mask[:q, past : past + q] = 0.0
        self._mask_block = (0, 0)

    def _tree_mask(self, parents: np.ndarray, past: int) -> torch.Tensor:
        # -> [1, 1, q, past+q] additive mask view: 0 = attend, finfo.min = blocked.
        # Invariant: _mask is all zeros except the block written last, so only the previous
        # and the new [q, q] blocks are written. Float, not bool: a bool mask is silently wrong
        # under the eager attention path.
        q = len(parents) + 1
        self._reset_mask()
        if self._mask.shape[0] < q or self._mask.shape[1] < past + q:
            rows = max(q, self._mask.shape[0])
            self._mask = torch.zeros(rows, max(self.cache.capacity, past + q), dtype=self.dtype, device=self.device)
        block = np.where(ancestor_matrix(parents), 0.0, self._blocked).astype(np.float32)
        self._mask[:q, past : past + q] = to_device(block, self.device)
        self._mask_block = (q, past)
        return self._mask[:q, : past + q][None, None]


def verify_input(t0: int, tree: DraftTree, device: torch.device) -> torch.Tensor:
    # -> [1 + m] int64 on device: the pending token then the draft nodes (placeholders -1)
    tokens = tree.tokens
    if not isinstance(tokens, torch.Tensor):
        return to_device(np.concatenate(([t0], np.asarray(tokens, dtype=np.int64))), device)
    ids = torch.empty(len(tree) + 1, dtype=torch.int64, device=device)
    ids[0] = t0  # a fill kernel: writing a host scalar needs no sync
    ids[1:] = tokens
    return ids


def final_norm(model: torch.nn.Module) -> torch.nn.Module:
    """The norm whose output is the lm_head input (Llama, Qwen2, Mistral: model.model.norm)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    norm = getattr(decoder, "norm", None)
    if not isinstance(norm, torch.nn.Module):
        raise UserError(f"{getattr(model.config, 'model_type', 'this model')}: no final norm found (model.model.norm), "
                        "so its last hidden states cannot be read for an EAGLE head: use another method")
    return norm


def _require_mask_attention(model: torch.nn.Module) -> None:
    config = model.config
    impl = getattr(config, "_attn_implementation", None)
    if impl is None or impl in MASK_ATTENTION:
        return
    try:
        model.set_attn_implementation("sdpa")
    except (AttributeError, ValueError, ImportError) as err:
        raise UserError(
            f"{getattr(config, 'model_type', 'this model')} is loaded with {impl} attention, which ignores "
            f"samctl's tree mask, and cannot switch to sdpa ({err}): load it with attn_implementation='sdpa'"
        ) from err
    if getattr(model.config, "_attn_implementation", None) not in MASK_ATTENTION:
        raise UserError(f"{config.model_type}: attention {impl} ignores the tree mask; load it with sdpa")


def _sliding_window(config) -> int | None:
    # The window of a model whose layers really use sliding attention, else None.
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    return int(window) if getattr(config, "use_sliding_window", True) else None

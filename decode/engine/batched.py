"""The target model for B sequences at once: a static KV cache with a batch dimension and a length
per row, batched prefill of newcomers, one verify forward over every row's draft tree, and the
accepted paths kept with one gather.

Layout: rows in flight occupy slots [0, A) of the cache (`move_row` keeps them packed when a row
leaves and none replaces it), so every forward runs on a contiguous view of A rows. A verify step
takes per row b a draft tree of q_b inputs ([t0, nodes...]); rows are padded to the widest,
q = max q_b, and row b's inputs go to cache positions [L_b, L_b + q) where L_b is its committed
length. The additive mask [A, 1, q, max L_b + q] lets input i of row b see the row's committed
entries [0, L_b) and its own tree ancestors in [L_b, L_b + q_b); everything else (other rows'
longer committed parts, padded inputs, the unused tail) is hidden. Padded inputs are written
into the cache behind L_b + q_b, where nothing real ever reads them, and are overwritten later.

Invariant: for every row, storage[..., b, :, :L_b, :] holds exactly the K/V a batch-1 engine holds
for that row's committed tokens, each computed at its true position; so a row's logits equal its
batch-1 logits up to floating-point summation order, whatever the other rows do.

Works with any Hugging Face causal LM that takes a 4D additive attention mask, explicit position
ids and a transformers Cache, under the sdpa or eager attention paths (flash and flex ignore a 4D
mask: the model is switched to sdpa or refused), or with samctl's native forward
(decode/engine/native.py). Sliding-window models work while prompt + output fit in the window,
which then caps the context. Knows nothing of drafters or acceptance rules; lengths live on the
host because the caller learns the accepted paths on the host anyway (the step's one sync).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from transformers.cache_utils import Cache

from samctl.decode.engine.attention import NAME as FOLDED, ROWWISE, exact_rows, use_folded_gqa
from samctl.decode.engine.kv_cache import OwnedLayer, aligned, with_cache
from samctl.decode.engine.native import native_of
from samctl.decode.engine.transfer import to_device
from samctl.decode.tree import DraftTree, ancestor_matrix
from samctl.index.errors import UserError

# Families whose causal-LM forward is `lm_head(decoder(...))` with nothing in between, so the head
# can run on the real (unpadded) inputs only. Others run the whole forward on the padded block.
PLAIN_HEAD = ("llama", "qwen2", "qwen3", "mistral")
# attention paths that apply a custom 4D additive mask (decode/engine/attention.py: FOLDED, ROWWISE)
MASK_ATTENTION = ("sdpa", "eager", FOLDED, ROWWISE)


class BatchedLayer(OwnedLayer):
    """One layer's view of the shared storage; writes where the owner's current mode says."""

    is_croppable = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states, value_states: [A, kv_heads, q, head_dim]
        owner = self.owner
        if owner.storage is None:
            owner.allocate_like(key_states)
        keys, values = owner.storage[0, self.index], owner.storage[1, self.index]  # [B, kvh, cap, hd]
        if owner.prefill_rows is not None:
            # prefill from empty rows: attention needs only the new entries; store them at 0..P
            p = key_states.shape[-2]
            keys[owner.prefill_rows, :, :p] = key_states
            values[owner.prefill_rows, :, :p] = value_states
            return key_states, value_states
        rows, _, q, dim = key_states.shape
        index = owner.write_positions[:, None, :, None].expand(rows, key_states.shape[1], q, dim)
        keys = keys.narrow(0, 0, rows)
        values = values.narrow(0, 0, rows)
        keys.scatter_(2, index, key_states)
        values.scatter_(2, index, value_states)
        return keys.narrow(2, 0, owner.kv_length), values.narrow(2, 0, owner.kv_length)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.kv_length, 0

    def get_seq_length(self) -> int:
        return self.owner.seen

    def reset(self) -> None:
        pass


class BatchedKVCache(Cache):
    """Storage [2, layers, B, kv_heads, capacity, head_dim], allocated at the first forward; the
    caller sets the mode of each forward (`prefill_rows`, or `write_positions` + `kv_length`)."""

    def __init__(self, num_layers: int, rows: int, capacity: int) -> None:
        super().__init__(layers=[BatchedLayer(self, i) for i in range(num_layers)])
        self.rows, self.capacity = rows, capacity
        self.storage: torch.Tensor | None = None
        self.prefill_rows: torch.Tensor | None = None  # [k] int64 slots being prefilled
        self.write_positions: torch.Tensor | None = None  # [A, q] int64 cache positions of the inputs
        self.kv_length = 0  # entries the verify's attention reads: max L_b + q
        self.seen = 0  # committed entries before a one-row forward's inputs (transformers' causal mask reads it)
        self.generation = 0  # storage allocations so far (CUDA graphs hold the storage's address)

    def allocate_like(self, key_states: torch.Tensor) -> None:
        # key_states: [k, kv_heads, q, head_dim] from layer 0's first forward
        _, heads, _, dim = key_states.shape
        shape = (2, len(self.layers), self.rows, heads, self.capacity, dim)
        self.set_storage(torch.zeros(shape, dtype=key_states.dtype, device=key_states.device))

    def set_storage(self, storage: torch.Tensor) -> None:
        self.storage = storage
        self.generation += 1


class BatchedTarget:
    """The model and a cache for up to `rows` sequences of at most `capacity` tokens each
    (prompt + output + the widest verify block). Verifies replay CUDA graphs once
    `enable_batch_graphs` (decode/engine/graphs.py) captured them, else run eagerly."""

    def __init__(self, model: torch.nn.Module, rows: int, capacity: int, fold_groups: bool | None = None) -> None:
        # fold_groups: grouped-query attention folds head groups into query rows instead of
        # copying K/V per head (decode.engine.attention); default: on CUDA
        self.model = model.eval()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        config = model.config
        _require_mask_attention(model)
        if fold_groups if fold_groups is not None else self.device.type == "cuda":
            use_folded_gqa(model)
        self.max_positions = int(getattr(config, "max_position_embeddings", 1 << 30) or (1 << 30))
        self.context_note = "the model's context"
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        # the ids the embedding takes (it may be resized past config.vocab_size)
        self.vocab_size = int(getattr(embeddings, "num_embeddings", 0) or getattr(config, "vocab_size", 0) or 0) or None
        window = _sliding_window(config)
        if window is not None and window < self.max_positions:
            # Beyond the window the model must stop seeing old tokens, which this engine's
            # full-context mask does not do: cap the context instead of computing wrong logits.
            self.max_positions = window
            self.context_note = (f"{getattr(config, 'model_type', 'this model')} uses sliding-window attention, "
                                 "which samctl supports only within the window; the window")
        if rows < 1 or capacity < 2:
            raise UserError(f"batch size must be >= 1 (got {rows}) and the capacity >= 2 (got {capacity})")
        self.rows = rows
        # a multiple of ALIGN, as batch 1's cache: every row's and head's keys start 64-byte aligned,
        # as a one-token step's do (attention exact per row hands the kernel the same layouts)
        self.capacity = aligned(capacity)
        self.cache = BatchedKVCache(int(model.config.num_hidden_layers), rows, self.capacity)
        self.lengths = np.zeros(rows, dtype=np.int64)  # committed entries per slot
        self._blocked = torch.finfo(self.dtype).min
        split = getattr(model.config, "model_type", "") in PLAIN_HEAD and hasattr(model, "lm_head")
        self._decoder = model.get_decoder() if split else None
        self.native = native_of(model)  # the native forward (decode/engine/native.py), or None: transformers'
        # attention exact per row (int8): a padded batch prefill would sum in another order than
        # batch 1's, so each prompt is prefilled alone, as batch 1 prefills it
        self._prefill_alone = exact_rows(model)
        self.graphs = None  # decode.engine.graphs.BatchVerifyGraphs, on CUDA only
        # hidden states (EAGLE heads): the final norm's output, from the same forwards: returned by
        # the native forward and the decoder of hf's PLAIN_HEAD families, else hooked on the norm
        self._norm = None if self.native is not None or self._decoder is not None else _final_norm(model)
        self.gives_hidden = self.native is not None or self._decoder is not None or self._norm is not None
        self.wants_hidden = False
        self.forward_hidden: torch.Tensor | None = None  # [A * q, H] of the last forward
        self.hidden: torch.Tensor | None = None  # [N, H] at the last verify's real inputs, as its logits
        self.prefill_hidden: list[torch.Tensor] = []  # per prompt of the last prefill: [n, H]
        self.eager_fallbacks = 0  # verifies run eagerly while graphs were on (too wide, or capture failed)

    # -- forwards -----------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None,
                keep: torch.Tensor | None, upto: int | None = None) -> torch.Tensor:
        # input_ids, position_ids: [A, q]; mask: [A or 1, 1, q, kv] (None: the model's causal mask); keep: [N] flat indices into
        # A * q of the inputs whose logits are wanted (None: all); upto: a host bound on the
        # positions -> logits [N, V]. The one place a forward of either backend runs. With
        # `wants_hidden`, `forward_hidden` is then [A * q, H], the final norm's output at every input.
        if self.native is not None:
            logits, hidden = self.native(input_ids, position_ids, mask, self.cache, keep, upto)
            self.forward_hidden = hidden if self.wants_hidden else None
            return logits
        if self._decoder is not None:
            hidden = self._decoder(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                                   **with_cache(self._decoder, self.cache), use_cache=True).last_hidden_state
            hidden = hidden.reshape(-1, hidden.shape[-1])
            self.forward_hidden = hidden if self.wants_hidden else None
            return self.model.lm_head(hidden if keep is None else hidden.index_select(0, keep))
        # other families: the whole model; hidden states, when wanted, from a hook on the final norm
        hook = self._norm.register_forward_hook(self._keep_hidden) if self.wants_hidden and self._norm else None
        try:
            logits = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                                **with_cache(self.model, self.cache), use_cache=True).logits
        finally:
            if hook is not None:
                hook.remove()
        if hook is None:
            self.forward_hidden = None
        logits = logits.reshape(-1, logits.shape[-1])
        return logits if keep is None else logits.index_select(0, keep)

    def _keep_hidden(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        # output: [A, q, H] the final norm's output = the lm_head input at every input
        self.forward_hidden = output.reshape(-1, output.shape[-1])

    @torch.inference_mode()
    def prefill(self, slots: Sequence[int], prompts: Sequence[np.ndarray], all_logits: Sequence[bool]) -> list[torch.Tensor]:
        # slots: [k] free slots; prompts: k host int64 arrays (1 <= len, len + verify room <= capacity)
        # -> per prompt its logits: [n, V] if all_logits[i] else [1, V] at the last position
        # (and, with wants_hidden, its hidden states [n, H] in prefill_hidden).
        # One forward, right-padded to the longest prompt: with right padding a plain causal mask
        # is exactly right for every real position.
        self.prefill_hidden = []
        if self._prefill_alone or len(slots) == 1:
            return [self._prefill_alone_one(s, p, a) for s, p, a in zip(slots, prompts, all_logits)]
        k = len(slots)
        lengths = np.array([len(p) for p in prompts], dtype=np.int64)
        width = int(lengths.max())
        self.reserve(width)
        ids = np.zeros((k, width), dtype=np.int64)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = p
        keep = np.concatenate([i * width + (np.arange(n) if a else np.array([n - 1]))
                               for i, (n, a) in enumerate(zip(lengths, all_logits))])
        causal = torch.full((width, width), self._blocked, dtype=self.dtype, device=self.device).triu_(1)
        self.cache.prefill_rows = to_device(np.asarray(slots, dtype=np.int64), self.device)
        try:
            logits = self.forward(to_device(ids, self.device),
                               torch.arange(width, device=self.device)[None].expand(k, width),
                               causal[None, None], to_device(keep, self.device))
        finally:
            self.cache.prefill_rows = None
        self.lengths[list(slots)] = lengths
        if self.forward_hidden is not None:
            self.prefill_hidden = [self.forward_hidden[i * width : i * width + n] for i, n in enumerate(lengths)]
        counts = np.where(np.asarray(all_logits), lengths, 1)
        return list(torch.split(logits, counts.tolist()))

    def _prefill_alone_one(self, slot: int, prompt: np.ndarray, all_logits: bool) -> torch.Tensor:
        # prompt: [n] host int64 -> logits [n, V] or [1, V]: a batch-1 forward with no mask, the
        # model's own causal mask ([n, n]: kv_length n)
        n = len(prompt)
        self.reserve(n)
        keep = np.arange(n) if all_logits else np.array([n - 1])
        self.cache.prefill_rows = to_device(np.array([slot], dtype=np.int64), self.device)
        self.cache.kv_length, self.cache.seen = n, 0
        try:
            logits = self.forward(to_device(np.asarray(prompt, dtype=np.int64)[None], self.device),
                               torch.arange(n, device=self.device)[None], None, to_device(keep, self.device))
        finally:
            self.cache.prefill_rows = None
        self.lengths[slot] = n
        if self.forward_hidden is not None:
            self.prefill_hidden.append(self.forward_hidden)
        return logits

    @torch.inference_mode()
    def verify(self, inputs: Sequence[torch.Tensor], trees: Sequence[DraftTree],
               last: bool = False) -> tuple[torch.Tensor, np.ndarray]:
        # inputs: A tensors [q_b] int64 = [t0, nodes...] of rows (slots) 0..A-1; trees: their drafts
        # -> (logits [N, V] of every real input, rows concatenated; offsets [A + 1] into them).
        # last: only each row's last input's logits ([A, V]; a draft model's chains).
        # Appends each row's block behind its committed entries; `keep` must follow.
        rows = len(inputs)
        sizes = np.array([len(t) + 1 for t in trees], dtype=np.int64)
        q = int(sizes.max())
        past = self.lengths[:rows]
        self.reserve(int(past.max()) + q)
        # 1) the padded input and the per-row positions (root at L_b, node i at L_b + depth)
        ids = torch.zeros(rows, q, dtype=torch.int64, device=self.device)
        rel = np.zeros((rows, q), dtype=np.int64)
        visible = np.zeros((rows, q, q), dtype=np.bool_)
        visible[:, np.arange(q), np.arange(q)] = True  # padded inputs see themselves (no empty rows)
        for b, (x, tree) in enumerate(zip(inputs, trees)):
            n = int(sizes[b])
            ids[b, :n] = x.clamp_min(0)  # placeholders (-1) are fed as 0
            if n > 1:
                rel[b, 1:n] = tree.depths()
                visible[b, :n, :n] = ancestor_matrix(np.asarray(tree.parents, dtype=np.int32))
        offsets = np.concatenate(([0], np.cumsum(sizes)))
        # 2) a graph of the step's buckets (CUDA), which computes positions and mask itself
        if self.graphs is not None:
            if self.graphs.covers(rows, q):
                out = self.graphs.run(ids, rel, visible, past)
                if out is not None:
                    logits, width = out
                    keep = to_device(np.arange(rows) * width + sizes - 1 if last else
                                     np.concatenate([b * width + np.arange(n) for b, n in enumerate(sizes)]), self.device)
                    self.hidden = None if self.graphs.hidden is None else self.graphs.hidden.index_select(0, keep)
                    return logits.index_select(0, keep), offsets
            self.eager_fallbacks += 1
        # 3) eagerly: the mask shows the committed prefix, the tree block by ancestry, hides the rest
        positions = to_device(past[:, None] + rel, self.device)
        write = to_device(past[:, None] + np.arange(q), self.device)
        kv = int(past.max()) + q
        if rows == 1 and trees[0].is_chain:
            mask = None  # one chain: the model's own causal mask after `seen` entries is exactly the tree mask
            self.cache.seen = int(past[0])
        else:
            mask = self.verify_mask(to_device(past, self.device), to_device(visible, self.device), kv)
        keep = to_device(np.arange(rows) * q + sizes - 1 if last else
                         np.concatenate([b * q + np.arange(n) for b, n in enumerate(sizes)]), self.device)
        self.cache.write_positions, self.cache.kv_length = write, kv
        try:
            logits = self.forward(ids, positions, mask, keep, upto=kv)
        finally:
            self.cache.write_positions = None
        self.hidden = None if self.forward_hidden is None else self.forward_hidden.index_select(0, keep)
        return logits, offsets

    def verify_mask(self, past: torch.Tensor, visible: torch.Tensor, kv: int) -> torch.Tensor:
        # past: [A] int64; visible: [A, q, q] bool ancestry within each row's block -> [A, 1, q, kv]
        # additive: 0 where row i of a row's block sees the key, finfo.min where not. Device ops
        # only (a CUDA graph computes it from its static inputs).
        rows, q, _ = visible.shape
        col = torch.arange(kv, device=self.device)[None, :] - past[:, None]  # [A, kv] relative column
        in_block = (col >= 0) & (col < q)
        block = visible.gather(2, col.clamp(0, q - 1)[:, None, :].expand(rows, q, kv))  # [A, q, kv]
        seen = (col < 0)[:, None, :] | (block & in_block[:, None, :])
        mask = torch.zeros(rows, 1, q, kv, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~seen[:, None], self._blocked)

    @torch.inference_mode()
    def keep(self, paths: Sequence[np.ndarray]) -> None:
        # paths: A arrays [a_b + 1] of input indices of each row's accepted path, root (0) first.
        # Chain-shaped paths (0..a) need nothing moved; the rest are gathered to the front of
        # their row's verified block for every layer at once (the gather copies first, so an
        # overlapping destination is safe).
        rows, dst, src = [], [], []
        for b, path in enumerate(paths):
            n = len(path)
            if n > 1 and path[-1] != n - 1:
                past = self.lengths[b]
                rows.append(np.full(n, b, dtype=np.int64))
                dst.append(past + np.arange(n, dtype=np.int64))
                src.append(past + np.asarray(path, dtype=np.int64))
            self.lengths[b] += n
        if rows:
            storage = self.cache.storage
            r = to_device(np.concatenate(rows), self.device)
            storage[:, :, r, :, to_device(np.concatenate(dst), self.device)] = \
                storage[:, :, r, :, to_device(np.concatenate(src), self.device)]

    @torch.inference_mode()
    def reserve(self, n: int) -> None:
        """Room for n entries per row, keeping the valid ones. Growth doubles (up to the model's
        context), so it is rare: on a GPU it recaptures every graph, seconds at a batch's buckets."""
        if n <= self.capacity:
            return
        self.capacity = self.cache.capacity = aligned(max(n, min(2 * self.capacity, self.max_positions)))
        self._reallocate(4, self.capacity)

    @torch.inference_mode()
    def move_row(self, src: int, dst: int) -> None:
        """Slot `src`'s committed entries become slot `dst`'s (packing rows into [0, A))."""
        n = int(self.lengths[src])
        if n and self.cache.storage is not None:
            self.cache.storage[:, :, dst, :, :n] = self.cache.storage[:, :, src, :, :n]
        self.lengths[dst], self.lengths[src] = n, 0

    @torch.inference_mode()
    def resize(self, rows: int) -> None:
        """`rows` slots: slots [0, rows) keep their entries, the rest are freed (after an
        out-of-memory) or added empty (a draft model's batch gaining a sequence)."""
        assert rows >= 1, rows
        kept = min(rows, self.rows)
        self._reallocate(2, rows)
        self.cache.rows = self.rows = rows
        self.lengths = np.concatenate((self.lengths[:kept], np.zeros(rows - kept, dtype=np.int64)))

    def _reallocate(self, dim: int, size: int) -> None:
        # new zeroed storage `size` long along `dim` (2: rows, 4: capacity), the old one's entries kept
        old = self.cache.storage
        if old is not None:
            shape = list(old.shape)
            shape[dim] = size
            self.cache.set_storage(torch.zeros(shape, dtype=old.dtype, device=old.device))
            kept = min(size, old.shape[dim])
            self.cache.storage.narrow(dim, 0, kept).copy_(old.narrow(dim, 0, kept))


def verify_input(t0: int, tree: DraftTree, device: torch.device) -> torch.Tensor:
    # -> [1 + m] int64 on device: the pending token then the draft nodes (placeholders -1)
    tokens = tree.tokens
    if not isinstance(tokens, torch.Tensor):
        return to_device(np.concatenate(([t0], np.asarray(tokens, dtype=np.int64))), device)
    ids = torch.empty(len(tree) + 1, dtype=torch.int64, device=device)
    ids[:1].fill_(t0)  # a fill kernel; `ids[0] = t0` would copy a host scalar, a sync on a GPU
    ids[1:] = tokens
    return ids


def _final_norm(model: torch.nn.Module) -> torch.nn.Module | None:
    """The norm whose output is the lm_head input (Llama, Qwen2, Mistral: model.model.norm); None
    when the model has none where it is looked for (decode.loop then refuses methods that need it)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    norm = getattr(decoder, "norm", None)
    return norm if isinstance(norm, torch.nn.Module) else None


def _require_mask_attention(model: torch.nn.Module) -> None:
    config = model.config
    impl = getattr(config, "_attn_implementation", None)
    if impl is None or impl in MASK_ATTENTION:
        return
    try:
        model.set_attn_implementation("sdpa")
    except (AttributeError, ValueError, ImportError) as err:
        raise UserError(f"{getattr(config, 'model_type', 'this model')} is loaded with {impl} attention, which "
                        f"ignores samctl's tree mask, and cannot switch to sdpa ({err}): load it with "
                        "attn_implementation='sdpa'") from err
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

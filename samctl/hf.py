"""samctl inside `model.generate`: a `custom_generate` callable that runs samctl's decode loop.

    import samctl.hf
    out = model.generate(**inputs, custom_generate=samctl.hf.custom_generate, max_new_tokens=200)
    fast = samctl.hf.make_generate(store="store.sam", method="adaptive", max_nodes=32)
    out = model.generate(**inputs, custom_generate=fast, do_sample=True, temperature=0.7, top_p=0.9)

transformers prepares the inputs, generation config, logits processors and stopping criteria, then
calls the callable with the model and `input_ids` [1, n]; it gets back `sequences` [1, n + k] (or a
`GenerateDecoderOnlyOutput` of only `sequences`). Honoured: `max_new_tokens`/`max_length`, the EOS
ids, `streamer`, `do_sample` with `temperature`, `top_k`, `top_p`; anything whose meaning samctl
cannot keep exactly (other processors or criteria, beams, batches, padding, scores, a pre-filled
cache) raises a UserError naming it. Greedy output equals plain `generate` token for token
(float32); sampling is seeded from torch's global generator, so `torch.manual_seed` reproduces it.

One session (engine, drafter) per model and callable is kept across calls, so the drafter's memory
carries over as in a `samctl generate` batch; samctl keeps its own KV cache. The model is put in
eval mode, and switched to sdpa attention if its attention ignores a 4D mask.
"""
from __future__ import annotations

import os
import sys
import weakref
from typing import Any

import torch

from samctl.decode.loop import GenerationConfig, generate as decode_generate
from samctl.decode.methods import DEFAULT_METHOD, method as method_entry, method_config, setting_names
from samctl.decode.sampling import SamplingConfig
from samctl.index.errors import UserError
from samctl.models import engine_for
from samctl.session import Session, SessionConfig
from samctl.stores import load_store

_STOPPING = ("MaxLengthCriteria", "EosTokenCriteria")  # the stopping criteria samctl applies itself
_OUTPUT_FLAGS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


class SamctlGenerate:
    """A `custom_generate` callable bound to a method, an optional store and drafter settings."""

    def __init__(self, store: str | os.PathLike | None = None, method: str = DEFAULT_METHOD,
                 tokenizer: Any = None, **settings: Any) -> None:
        entry = method_entry(method)
        # by the SessionConfig fields its errors name (`pass eagle_head=`)
        self.files = {name: os.fspath(settings.pop(name)) for name in ("draft_model", "acc_head", "eagle_head")
                      if settings.get(name) is not None}
        unknown = sorted(set(settings) - set(setting_names()))
        if unknown:
            raise UserError(f"unknown setting {unknown[0]!r} for samctl.hf.make_generate: "
                            f"choose from {', '.join(setting_names())}")
        method_config(settings)  # a bad value is refused here, not at the first generate
        if store is not None and not entry.uses_store:
            raise UserError(f"method {method} does not draft from a store: drop store= or use method={DEFAULT_METHOD!r}")
        for name in sorted(set(self.files) - entry.requires):
            raise UserError(f"method {method} does not use {name}=: drop it, or use a method that needs it")
        self.method = method
        self.store_path = None if store is None else os.fspath(store)
        self.tokenizer = tokenizer
        self.settings = settings
        self.last_metrics = None  # decode.metrics.Metrics of the latest call: tokens/step, timings

    def __repr__(self) -> str:
        files = "".join(f", {name}={path!r}" for name, path in self.files.items())
        return f"samctl.hf.make_generate(store={self.store_path!r}, method={self.method!r}{files}, **{self.settings!r})"

    def __call__(self, model, input_ids: torch.LongTensor, logits_processor=None, stopping_criteria=None,
                 generation_config=None, synced_gpus: bool = False, streamer=None, **model_kwargs: Any):
        # input_ids: [1, n] int64 -> sequences [1, n + k] (or GenerateDecoderOnlyOutput)
        # The signature mirrors GenerationMixin._sample, so transformers passes nothing else.
        _check_inputs(model, input_ids, generation_config, synced_gpus, model_kwargs)
        sampling = _sampling(logits_processor or [], generation_config)
        max_length, eos = _stopping(stopping_criteria or [])
        n = int(input_ids.shape[1])
        if max_length is None or max_length - n < 1:
            raise UserError(f"no room to generate: max_length {max_length} for a {n}-token prompt; "
                            "pass max_new_tokens")
        streamer = streamer if streamer is not None else _callers_streamer()
        session = self._session(model)
        config = GenerationConfig(max_new_tokens=max_length - n, eos_token_ids=eos, sampling=sampling)

        def on_tokens(tokens: list[int]) -> None:
            streamer.put(torch.tensor(tokens, dtype=torch.long))

        result = decode_generate(session.engine.target, session.drafter, input_ids[0].tolist(), config,
                                 on_tokens=on_tokens if streamer is not None else None)
        if streamer is not None:
            streamer.end()
        new = torch.tensor([result.tokens], dtype=input_ids.dtype, device=input_ids.device)
        sequences = torch.cat((input_ids, new), dim=1)
        self.last_metrics = result.metrics
        if generation_config is not None and generation_config.return_dict_in_generate:
            from transformers.generation.utils import GenerateDecoderOnlyOutput

            return GenerateDecoderOnlyOutput(sequences=sequences)
        return sequences

    def _session(self, model) -> Session:
        # The sessions hang off the model (keyed weakly by this callable): a session holds the
        # model, so a table owned here would keep every model ever used alive.
        sessions = model.__dict__.setdefault("_samctl_sessions", weakref.WeakKeyDictionary())
        session = sessions.get(self)
        if session is None:
            engine = engine_for(model, self.tokenizer)
            needs = method_entry(self.method).requires - {"sat_model"}
            if engine.tokenizer is None and (self.store_path is not None or needs):
                # stores, draft models and heads name the tokenizer they were made with
                what = f"the store {self.store_path}" if self.store_path is not None else f"the {' and '.join(sorted(needs))}"
                engine.tokenizer = _model_tokenizer(engine.name, what)
            config = SessionConfig(method=self.method, store=self.store_path, settings=self.settings, quiet=True,
                                   occurrence=self.settings.get("occurrence", "first"), **self.files)
            store = load_store(self.store_path, engine, config.occurrence)
            session = sessions[self] = Session.over(engine, config, store)
        return session


def make_generate(store: str | os.PathLike | None = None, method: str = DEFAULT_METHOD, *,
                  tokenizer: Any = None, **settings: Any) -> SamctlGenerate:
    """A `custom_generate` callable that drafts with `method` from `store` (a `.sam` file built
    with the model's tokenizer; `tokenizer` checks it, loaded from the model's folder when not
    given). `settings` are the drafters' options as on the command line, with underscores
    (`max_nodes=32`, `sam_threshold=3`; see `setting_names()`), and the files a method requires:
    `eagle_head` (default: the one installed beside the model, X.eagle; `samctl train eagle` writes
    one), `draft_model` (sd, specdec++, sam+draft, ouroboros), `acc_head` (specdec++)."""
    return SamctlGenerate(store, method, tokenizer, **settings)


custom_generate = SamctlGenerate()
"""The default method with no store: `model.generate(..., custom_generate=samctl.hf.custom_generate)`."""


# -- what transformers hands over, checked ----------------------------------------------------


def _check_inputs(model, input_ids: torch.Tensor, generation_config, synced_gpus: bool,
                  model_kwargs: dict[str, Any]) -> None:
    if getattr(model.config, "is_encoder_decoder", False):
        raise UserError("samctl.hf decodes decoder-only models; this one is encoder-decoder: use plain generate")
    if generation_config is not None:
        if generation_config.num_beams > 1:
            raise UserError(f"samctl.hf does not do beam search (num_beams={generation_config.num_beams}): "
                            "drop num_beams, or use plain generate")
        on = [flag for flag in _OUTPUT_FLAGS if getattr(generation_config, flag, False)]
        if on and generation_config.return_dict_in_generate:
            raise UserError(f"samctl.hf returns sequences only, not {on[0]}: drop {on[0]}=True")
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise UserError("samctl.hf needs input_ids (token ids, not inputs_embeds) of shape [1, n], n >= 1")
    if input_ids.shape[0] != 1:
        raise UserError(f"samctl.hf generates for one prompt at a time, got a batch of {input_ids.shape[0]} "
                        "(or num_return_sequences > 1): call generate once per prompt")
    if synced_gpus:
        raise UserError("samctl.hf does not run under synced_gpus (DeepSpeed ZeRO-3/FSDP): use plain generate")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool((mask == 1).all()):
        raise UserError("samctl.hf got a padded prompt (attention_mask has zeros): pass the prompt unpadded")
    for name in ("cache", "past_key_values"):  # transformers 5.24 renamed past_key_values to cache
        cache = model_kwargs.get(name)
        if cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0:
            raise UserError(f"samctl.hf starts from the prompt and keeps its own cache: drop {name}")


def _sampling(processors, generation_config) -> SamplingConfig:
    """The prepared logits processors, which must be exactly samctl's warpers, in transformers' order."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    do_sample = bool(generation_config is not None and generation_config.do_sample)
    values: dict[str, Any] = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}  # the warpers' fields in `order`, unset
    order = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
    rank = -1
    for proc in processors:
        kind = type(proc)
        if kind not in order or not do_sample:
            raise UserError(f"samctl.hf cannot apply {kind.__name__} and stay exact: drop the setting that adds it "
                            "(repetition_penalty, min_new_tokens, bad_words_ids, ...) or use plain generate")
        if order.index(kind) <= rank or getattr(proc, "min_tokens_to_keep", 1) != 1:
            raise UserError(f"samctl.hf applies temperature, top_k, top_p once each, in that order, keeping at "
                            f"least 1 token; {kind.__name__} breaks that: use plain generate")
        rank = order.index(kind)
        name = list(values)[rank]
        values[name] = type(values[name])(getattr(proc, name))
    if not do_sample:
        return SamplingConfig()
    return SamplingConfig(**values, seed=int(torch.randint(0, 2**62, (1,)).item()))


def _stopping(criteria) -> tuple[int | None, tuple[int, ...]]:
    """(max_length, EOS ids); any other criterion is refused."""
    max_length, eos = None, ()
    for crit in criteria:
        name = type(crit).__name__
        if name not in _STOPPING:
            raise UserError(f"samctl.hf cannot apply the stopping criterion {name}: drop it (stop_strings, "
                            "max_time, custom criteria) or use plain generate")
        if name == "MaxLengthCriteria":
            max_length = int(crit.max_length) if max_length is None else min(max_length, int(crit.max_length))
        else:
            eos = tuple(sorted(int(t) for t in torch.as_tensor(crit.eos_token_id).flatten().tolist()))
    return max_length, eos


def _callers_streamer():
    """The `streamer` of the calling `GenerationMixin.generate`, or None: transformers 5.23 hands a
    callable custom_generate only the parameters it adds beyond `_sample`'s, so it is read from
    `generate`'s frame."""
    frame = sys._getframe(1)
    for _ in range(6):
        frame = frame.f_back
        if frame is None:
            return None
        if frame.f_code.co_name == "generate" and frame.f_globals.get("__name__") == "transformers.generation.utils":
            return frame.f_locals.get("streamer")
    return None


def _model_tokenizer(name: str, what: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"cannot load the tokenizer of {name!r} to check {what}: pass "
                        "tokenizer= to samctl.hf.make_generate") from err


__all__ = ["custom_generate", "make_generate", "setting_names", "SamctlGenerate"]

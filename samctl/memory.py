"""Cross-request memory on disk: `--memory-file store.sam` preloads it, `--memory-save` writes it.

The memory file is an ordinary automaton store (`samctl info` and `query` read it), one document
per remembered output; it is checked against the model's tokenizer like any store and written
atomically.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from samctl.index.automaton import SuffixAutomaton
from samctl.index.datastore import BuildConfig, CorpusStats, StoreMeta, save_datastore
from samctl.index.errors import UserError
from samctl.runtime import Engine, load_store
from samctl.tokenizer import tokenizer_fingerprint


def load_memory(path: str, engine: Engine, drafter) -> int:
    """Preload the drafter's memory from a store; returns the number of documents."""
    if not drafter.keeps_memory:
        raise UserError(f"method {drafter.name} keeps no memory across requests: drop --memory-file "
                        "or use --method adaptive, lookahead or ouroboros")
    store = load_store(path, engine)
    if not isinstance(store.structure, SuffixAutomaton):
        raise UserError(f"{path} is not a single automaton store: a memory file is one .sam automaton store "
                        "(samctl build --kind sam without --shards, or one written by --memory-save)")
    tokens = np.asarray(store.structure.tokens)
    ends = np.flatnonzero(tokens < 0)
    starts = np.concatenate(([0], ends[:-1] + 1))
    documents = [tokens[s:e] for s, e in zip(starts, ends) if e > s]
    drafter.load_memory(documents)
    return len(documents)


def save_memory(path: str, engine: Engine, drafter) -> int:
    """Write the drafter's memory as an automaton store; returns the number of documents."""
    if not drafter.keeps_memory:
        raise UserError(f"method {drafter.name} keeps no memory across requests: drop --memory-save")
    documents = [np.asarray(d, dtype=np.int32) for d in drafter.memory_documents() if len(d)]
    tokens = np.concatenate(documents) if documents else np.zeros(0, dtype=np.int32)
    offsets = np.concatenate(([0], np.cumsum([len(d) for d in documents]))).astype(np.int64)
    automaton = SuffixAutomaton.build(tokens, offsets)
    eos = engine.eos_token_ids[0] if engine.eos_token_ids else None
    meta = StoreMeta(tokenizer_name=engine.name, tokenizer_fingerprint=tokenizer_fingerprint(engine.tokenizer),
                     vocab_size=engine.vocab_size, eos_token_id=eos,
                     build=BuildConfig(kind="sam", append_eos=False),
                     corpus=CorpusStats(documents=len(documents), tokens=int(len(tokens)),
                                        inputs=(f"memory of {Path(path).name}",)))
    save_datastore(path, automaton, meta)
    return len(documents)

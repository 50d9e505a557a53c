"""Loading stores: a `.sam` store checked against the model's tokenizer, and the cross-request
memory kept as an automaton store (`memory_file` reads one, `generate --memory-save` writes one,
one document per remembered output)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from samctl.index.automaton import SuffixAutomaton
from samctl.index.datastore import BuildConfig, CorpusStats, Datastore, StoreMeta, save_datastore
from samctl.index.errors import ConfigError
from samctl.index.load import load_datastore
from samctl.models import Engine
from samctl.tokenizer import check_store_tokenizer, tokenizer_fingerprint


def load_store(path: str | None, engine: Engine, occurrence: str = "first") -> Datastore | None:
    """Load a store and check that it was built with the model's tokenizer."""
    if path is None:
        return None
    store = load_datastore(path, occurrence=occurrence)
    check_store_tokenizer(store.meta, str(path), tokenizer_fingerprint(engine.tokenizer), engine.name, model=True)
    return store


def load_memory(path: str, engine: Engine, drafter) -> int:
    """Preload the drafter's memory from a store; returns the number of documents."""
    if not drafter.keeps_memory:
        raise ConfigError("method {name} keeps no memory across requests: drop {memory_file}, or choose "
                          "{method} adaptive, adaptive+eagle, lookahead or ouroboros", name=drafter.name)
    store = load_store(path, engine)
    if not isinstance(store.structure, SuffixAutomaton):
        raise ConfigError("{path} is not a single automaton store: a {memory_file} is one .sam automaton store "
                          "(built with {kind} sam and no {shards}, or one written by {memory_save})", path=path)
    tokens = np.asarray(store.structure.tokens)  # the documents, each followed by its separator (-1)
    documents = [d[:-1] for d in np.split(tokens, np.flatnonzero(tokens < 0) + 1) if len(d) > 1 and d[-1] < 0]
    drafter.load_memory(documents)
    return len(documents)


def save_memory(path: str, engine: Engine, drafter) -> int:
    """Write the drafter's memory as an automaton store; returns the number of documents."""
    if not drafter.keeps_memory:
        raise ConfigError("method {name} keeps no memory across requests: drop {memory_save}", name=drafter.name)
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


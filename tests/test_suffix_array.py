"""Suffix-array stores (index/suffix_array.py): the automaton's answers from a suffix array, untrusted
manifests and files, the drafters and commands over an `sa` store, sharded or not. Skipped without
infini-gram."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

pytest.importorskip("infini_gram", reason="suffix-array stores need infini-gram: pip install 'samctl[sa]'")

from samctl.index.automaton import SuffixAutomaton  # noqa: E402
from samctl.index.cursor import cursor  # noqa: E402
from samctl.index.datastore import BuildConfig, CorpusStats, StoreMeta  # noqa: E402
from samctl.index.load import load_datastore  # noqa: E402
from samctl.index.lookup import Lookup  # noqa: E402
from samctl.index.store import StoreError  # noqa: E402
from samctl.index.suffix_array import build_suffix_array, load_suffix_array  # noqa: E402


def corpus(seed: int, vocab: int = 5, n_docs: int = 8) -> tuple[np.ndarray, np.ndarray]:
    # five ids: long matches and shared substrings across documents are common. A larger
    # vocabulary spreads them over both bytes (byte order is not id order).
    rng = np.random.default_rng(seed)
    ids = np.array([0, 1, 255, 256, vocab - 1]) if vocab > 257 else np.arange(vocab)
    docs = [ids[rng.integers(0, len(ids), rng.integers(1, 30))] for _ in range(n_docs)]
    offsets = np.concatenate(([0], np.cumsum([len(d) for d in docs]))).astype(np.int64)
    return np.concatenate(docs).astype(np.int32), offsets


def meta(tokens: np.ndarray, offsets: np.ndarray, vocab: int) -> StoreMeta:
    return StoreMeta(tokenizer_name="test", tokenizer_fingerprint="fp", vocab_size=vocab, eos_token_id=None,
                     build=BuildConfig(kind="sa"), corpus=CorpusStats(documents=len(offsets) - 1, tokens=len(tokens)))


def build(path, seed: int, vocab: int = 5):
    tokens, offsets = corpus(seed, vocab)
    return build_suffix_array(path, tokens, offsets, meta(tokens, offsets, vocab), memory_limit=64 << 20), tokens, offsets


@pytest.mark.parametrize("seed", range(8))
def test_queries_equal_the_automatons(tmp_path, seed):
    """Match length, count, first-occurrence continuation and top-k next tokens equal the
    automaton's over the same documents (so no match crosses two documents)."""
    vocab = 0xFFFE if seed == 7 else 5  # seed 7: the largest vocabulary 16 bits hold beside the separator
    store, tokens, offsets = build(tmp_path / "s.sa", seed, vocab=vocab)
    sa, sam = store.structure, SuffixAutomaton.build(tokens, offsets)
    rng = np.random.default_rng(100 + seed)
    for _ in range(150):
        start = rng.integers(0, len(tokens))
        context = np.concatenate((tokens[start:start + rng.integers(0, 12)], tokens[rng.integers(0, len(tokens), 3)]))
        state, length = sam.match(context.astype(np.int32))
        lo, hi, sa_length = sa.match(context)
        assert sa_length == length, context
        if length:
            assert hi - lo == sam.count(state)
            for k in (1, 3, 8):
                np.testing.assert_array_equal(np.stack(sa.topk_next(lo, hi, length, k)), np.stack(sam.topk_next(state, k)))
        np.testing.assert_array_equal(sa.continuation(lo, hi, sa_length, 9), sam.continuation(state, 9))


@pytest.mark.parametrize("seed", range(4))
def test_cursor_streams_like_the_automatons(tmp_path, seed):
    """peek / advance / draft / tree over a growing text: the suffix array's cursor answers what the
    automaton's does (the REST tree included)."""
    store, tokens, offsets = build(tmp_path / "s.sa", seed)
    sa_cursor, sam_cursor = cursor(store.structure), cursor(SuffixAutomaton.build(tokens, offsets))
    rng = np.random.default_rng(seed)
    text = tokens[: rng.integers(1, 6)]
    sa_cursor.reset(text)
    sam_cursor.reset(text)
    for _ in range(60):
        t0 = int(rng.integers(0, 5))
        (a_len, a), (b_len, b) = sa_cursor.peek(t0), sam_cursor.peek(t0)
        assert a_len == b_len
        np.testing.assert_array_equal(sa_cursor.draft(a, 7), sam_cursor.draft(b, 7))
        for span in (2, 16):
            for got, want in zip(sa_cursor.tree(a, a_len, span, 12, 4), sam_cursor.tree(b, b_len, span, 12, 4)):
                np.testing.assert_array_equal(got, want)
        step = np.concatenate(([t0], rng.integers(0, 5, rng.integers(0, 3)))).astype(np.int32)
        sa_cursor.advance(step)
        sam_cursor.advance(step)


def test_damaged_truncated_and_foreign_stores_are_refused(tmp_path):
    path = tmp_path / "s.sa"
    build(path, 0)
    assert load_datastore(path).kind == "sa"
    load_suffix_array(path, verify=True)

    def copy(name: str):
        target = tmp_path / name
        shutil.copytree(path, target)
        return target

    truncated = copy("truncated.sa")
    with open(truncated / "table.0", "r+b") as f:
        f.truncate(os.path.getsize(truncated / "table.0") - 1)
    flipped = copy("flipped.sa")
    with open(flipped / "tokenized.0", "r+b") as f:
        f.seek(3)
        byte = f.read(1)
        f.seek(3)
        f.write(bytes([byte[0] ^ 1]))
    newer = copy("newer.sa")
    manifest = json.loads((newer / "manifest.json").read_text())
    (newer / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    lying = copy("lying.sa")
    manifest["sa"]["tokens"] += 1
    (lying / "manifest.json").write_text(json.dumps(manifest))
    foreign = tmp_path / "foreign.sa"
    foreign.mkdir()
    (foreign / "manifest.json").write_text('{"format": "something else", "kind": "sa"}')
    garbled = copy("garbled.sa")
    (garbled / "manifest.json").write_text('{"format": "samctl-sa-st')
    lost = copy("lost.sa")
    (lost / "manifest.json").unlink()
    for store, message in ((truncated, "truncated"), (newer, "upgrade samctl"), (lying, "disagree"),
                           (foreign, "format is not"), (garbled, "not JSON"), (lost, "manifest.json is missing")):
        with pytest.raises(StoreError, match=message) as err:
            load_datastore(store)
        assert "\n" not in str(err.value)
        assert "--kind sa" in str(err.value), err.value  # not the sharded stores' --shards N
    load_datastore(flipped)  # sizes agree: only the checksum tells
    with pytest.raises(StoreError, match="checksum"):
        load_datastore(flipped, verify=True)


def test_vocabularies_past_16_bits_are_refused_in_one_line(tmp_path):
    tokens, offsets = corpus(0)
    with pytest.raises(Exception, match="16-bit token ids") as err:
        build_suffix_array(tmp_path / "s.sa", tokens, offsets, meta(tokens, offsets, 0xFFFF))
    assert "\n" not in str(err.value) and not (tmp_path / "s.sa").exists()


# ---------------------------------------------------------------------------------------------
# drafting: every store-reading method, unchanged, from an `sa` store


@pytest.mark.parametrize("method", ["sam", "rest"])
def test_store_methods_replay_alike_from_suffix_array_and_automaton(tmp_path, method):
    """Same corpus, same trace: `sam` and `rest` draft exactly what they draft from the automaton."""
    import torch

    from samctl.decode.methods import MethodConfig, make_drafter
    from samctl.decode.simulate import make_trace, replay

    rng = np.random.default_rng(5)
    docs = [rng.integers(3, 300, 400) for _ in range(3)]
    offsets = np.concatenate(([0], np.cumsum([len(d) for d in docs]))).astype(np.int64)
    tokens = np.concatenate(docs).astype(np.int32)
    sa = build_suffix_array(tmp_path / "s.sa", tokens, offsets, meta(tokens, offsets, 300), memory_limit=64 << 20)
    prompt = np.concatenate((rng.integers(3, 300, 20), docs[1][50:60]))
    trace = make_trace(prompt, docs[1][60:250])
    results = []
    for static in (sa.structure, SuffixAutomaton.build(tokens, offsets)):
        drafter = make_drafter(method, vocab_size=300, device=torch.device("cpu"), eos_token_ids=(), static=static,
                               config=MethodConfig())
        results.append(replay(drafter, trace).to_dict())
    assert results[0]["mean_accepted"] > 3, results[0]
    same = ("steps", "accept_hist", "drafted", "accepted")
    assert [results[0][k] for k in same] == [results[1][k] for k in same]


def test_adaptive_drafts_long_matches_from_a_suffix_array(tmp_path):
    from samctl.decode.drafters.adaptive import AdaptiveConfig, AdaptiveDrafter
    from samctl.decode.simulate import make_trace, replay

    corpus_ids = np.random.default_rng(7).integers(3, 500, 500).astype(np.int32)
    offsets = np.array([0, len(corpus_ids)])
    sa = build_suffix_array(tmp_path / "s.sa", corpus_ids, offsets, meta(corpus_ids, offsets, 500),
                            memory_limit=64 << 20)
    prompt = np.concatenate((np.random.default_rng(8).integers(3, 500, 20), corpus_ids[100:110]))
    drafter = AdaptiveDrafter(AdaptiveConfig(recycle=False), static=sa.structure)
    m = replay(drafter, make_trace(prompt, corpus_ids[110:300]))
    assert m.mean_accepted > 6, m.to_dict()


# ---------------------------------------------------------------------------------------------
# commands: build, info, query, simulate take an `sa` store; build and query stay light


CODE = "def add(a, b):\n    return a + b\n"


def _samctl(*args: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "samctl", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_build_info_query_answer_like_an_automaton_store(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.py").write_text(CODE * 3)
    (tmp_path / "docs" / "b.md").write_text("The quick brown fox.\n" + CODE)
    answers = {}
    for kind, out in (("sa", "s.sa"), ("sam", "s.sam")):
        proc = _samctl("build", str(tmp_path / "docs"), "-o", str(tmp_path / out), "--kind", kind, "--tokenizer", "bytes")
        assert proc.returncode == 0, proc.stderr
        query = _samctl("query", str(tmp_path / out), "--text", "def add(a, b", "--json")
        assert query.returncode == 0, query.stderr
        answers[kind] = {k: v for k, v in json.loads(query.stdout).items() if k != "kind"}
    assert answers["sa"] == answers["sam"] and answers["sa"]["match_length"] == 12
    info = json.loads(_samctl("info", str(tmp_path / "s.sa"), "--json", "--verify").stdout)
    assert info["kind"] == "sa" and info["tokens"] == len(CODE * 4) + len("The quick brown fox.\n") + 2
    assert info["verified"] and info["bytes_per_token"] < 12
    text = _samctl("info", str(tmp_path / "s.sa")).stdout
    assert "sa (suffix array)" in text and "suffixes" in text
    # a store directory is replaced only by a store; a file at -o is refused in one line
    (tmp_path / "file").write_text("x")
    proc = _samctl("build", str(tmp_path / "docs"), "-o", str(tmp_path / "file"), "--kind", "sa", "--tokenizer", "bytes")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "is a file" in proc.stderr
    proc = _samctl("build", str(tmp_path / "docs"), "-o", str(tmp_path / "x.sa"), "--kind", "sa", "--tokenizer", "bytes",
                   "--memory-limit", "1M")
    assert proc.returncode == 2 and "--memory-limit" in proc.stderr and proc.stderr.count("\n") == 1
    proc = _samctl("build", "--append-to", str(tmp_path / "s.sam"), str(tmp_path / "docs"), "-o",
                   str(tmp_path / "s2.sam"), "--kind", "sa")
    assert proc.returncode == 2 and "drop --kind sa" in proc.stderr


def test_build_and_query_with_a_tokenizer_json_load_neither_torch_nor_transformers(tmp_path):
    import subprocess
    import sys

    from tests.conftest import save_hub_style_tokenizer

    save_hub_style_tokenizer(tmp_path / "hub")
    (tmp_path / "a.txt").write_text("The quick brown fox jumps over the lazy dog.\n" + CODE)
    probe = ("import sys\nfrom samctl.cli import main\n"
             "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
             "sys.stderr.write('MODULES ' + ' '.join(sorted({m.split('.')[0] for m in sys.modules})) + '\\n')\n")
    store = str(tmp_path / "s.sa")
    for args in (["build", str(tmp_path / "a.txt"), "-o", store, "--kind", "sa", "--tokenizer", str(tmp_path / "hub")],
                 ["query", store, "--text", "quick brown"], ["info", store]):
        proc = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
        line = next(line for line in proc.stderr.splitlines() if line.startswith("MODULES "))
        assert not set(line.split()[1:]) & {"torch", "transformers"}, (args, proc.stderr)
    assert os.path.isdir(store)


@pytest.mark.slow
def test_simulate_drafts_from_an_sa_store(tmp_path):
    traces = tmp_path / "traces.jsonl"
    traces.write_text(json.dumps({"prompt": "Repeat: " + CODE, "output": CODE * 2, "category": "copy"}) + "\n")
    (tmp_path / "corpus.jsonl").write_text(json.dumps({"text": CODE * 3}) + "\n")
    assert _samctl("build", str(tmp_path / "corpus.jsonl"), "-o", str(tmp_path / "s.sa"), "--kind", "sa",
                   "--tokenizer", "bytes").returncode == 0
    proc = _samctl("simulate", "--traces", str(traces), "--sam", str(tmp_path / "s.sa"), "--methods",
                   "ar,sam,rest,adaptive", "--json")
    assert proc.returncode == 0, proc.stderr
    methods = json.loads(proc.stdout)["methods"]
    for name in ("sam", "rest", "adaptive"):
        assert methods[name]["overall"]["mean_accepted"] > 1.5, (name, methods[name])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["sam", "adaptive", "rest"])
def test_batched_engine_drafts_from_an_sa_store_and_stays_greedy(tiny_model_dir, tmp_path, method):
    """The batched engine, rows refilled, drafting from a suffix array: plain greedy output, token for token."""
    import torch
    from transformers import AutoModelForCausalLM

    from samctl.decode.loop import generate_batch
    from samctl.decode.loop import GenerationConfig
    from samctl.decode.methods import make_drafter
    from tests.test_batched import CHEAP, EAGER, NEW, _references, mixed_prompts

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    prompts = mixed_prompts(vocab)
    plain, eos, expected = _references(f"{tiny_model_dir}-hf", model, prompts)
    tokens = np.concatenate([np.asarray(r, dtype=np.int32) for r in plain])
    offsets = np.concatenate(([0], np.cumsum([len(r) for r in plain]))).astype(np.int64)
    sa = build_suffix_array(tmp_path / "s.sa", tokens, offsets, meta(tokens, offsets, vocab), memory_limit=64 << 20)

    def make():
        return make_drafter(method, vocab_size=vocab, device=torch.device("cpu"), eos_token_ids=(eos,),
                            static=sa.structure, config=EAGER)

    results = generate_batch(model, make, prompts, GenerationConfig(max_new_tokens=NEW, eos_token_ids=(eos,)), 3,
                             cost=CHEAP)
    assert [r.tokens for r in results] == expected
    assert max(r.metrics.accepted for r in results) > 0


def test_append_to_rebuilds_over_the_stored_documents_and_the_new(tmp_path):
    """`--append-to` on an sa store answers as one build over the old inputs followed by the new."""
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "a.py").write_text(CODE * 2)
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "b.md").write_text("The quick brown fox.\n" + CODE)
    def build(*args):
        proc = _samctl("build", *args, "--tokenizer", "bytes", "-q")
        assert proc.returncode == 0, proc.stderr

    build(str(tmp_path / "old"), "-o", str(tmp_path / "s.sa"), "--kind", "sa")
    build("--append-to", str(tmp_path / "s.sa"), str(tmp_path / "new"), "-o", str(tmp_path / "s.sa"))
    build(str(tmp_path / "old"), str(tmp_path / "new"), "-o", str(tmp_path / "full.sa"), "--kind", "sa")
    grown, full = load_datastore(tmp_path / "s.sa"), load_datastore(tmp_path / "full.sa")
    assert grown.meta.corpus.documents == full.meta.corpus.documents == 2
    for name in ("tokenized.0", "table.0", "offset.0"):
        assert (tmp_path / "s.sa" / name).read_bytes() == (tmp_path / "full.sa" / name).read_bytes(), name


# ---------------------------------------------------------------------------------------------
# sharded suffix-array stores (index/sharded.py): one sa store's answers from whole-document shards


def build_sharded(path, tokens: np.ndarray, offsets: np.ndarray, n: int, vocab: int = 5):
    from samctl.index.sharded import StoreDirectoryWriter, build_shard, plan_shards

    whole = meta(tokens, offsets, vocab)
    bounds = plan_shards(offsets, n)
    with StoreDirectoryWriter(path) as writer:
        entries = []
        for i in range(n):
            lo, hi = offsets[bounds[i]], offsets[bounds[i + 1]]
            entries.append(build_shard(writer.shard_path(i, "sa"), tokens[lo:hi],
                                       offsets[bounds[i]:bounds[i + 1] + 1] - lo, whole, 64 << 20)[0])
        writer.commit(whole, entries)
    return load_datastore(path)


@pytest.mark.parametrize("seed, n", [(0, 2), (1, 3), (2, 2), (3, 4)])
def test_sharded_store_answers_as_one_suffix_array_and_the_automaton(tmp_path, seed, n):
    """Random documents (shorter than MAX_MATCH, so no re-search cap bites), random contexts:
    lookups and a streaming cursor over the shards give one sa store's (and the automaton's)
    match length, count, next tokens and continuation; ties go to the earliest occurrence."""
    tokens, offsets = corpus(seed, n_docs=10)
    one = build_suffix_array(tmp_path / "one.sa", tokens, offsets, meta(tokens, offsets, 5), memory_limit=64 << 20)
    sharded = build_sharded(tmp_path / "s.samd", tokens, offsets, n)
    assert sharded.kind == "sa" and len(sharded.shards) == n
    sam = SuffixAutomaton.build(tokens, offsets)
    rng = np.random.default_rng(200 + seed)
    for _ in range(150):
        start = rng.integers(0, len(tokens))
        context = np.concatenate((tokens[start:start + rng.integers(0, 12)], tokens[rng.integers(0, len(tokens), 3)]))
        answers = [store.lookup(context, 9, 4) for store in (one, sharded)]
        state, length = sam.match(context.astype(np.int32))
        tok, cnt = sam.topk_next(state, 4) if length else (np.zeros(0, np.int32),) * 2
        answers.append(Lookup(length, sam.count(state) if length else 0, sam.continuation(state, 9), tok, cnt))
        got = [(a.match_length, a.count, a.continuation.tolist(), a.next_tokens.tolist(), a.next_counts.tolist())
               for a in answers]
        assert got[0] == got[1] == got[2], context
    one_cursor, shards_cursor = cursor(one.structure), cursor(sharded.structure)
    text = tokens[: rng.integers(1, 6)]
    one_cursor.reset(text)
    shards_cursor.reset(text)
    for _ in range(80):
        t0 = int(rng.integers(0, 5))
        (a_len, a), (b_len, b) = one_cursor.peek(t0), shards_cursor.peek(t0)
        assert a_len == b_len
        np.testing.assert_array_equal(one_cursor.draft(a, 7), shards_cursor.draft(b, 7))
        step = np.concatenate(([t0], rng.integers(0, 5, rng.integers(0, 3)))).astype(np.int32)
        one_cursor.advance(step)
        shards_cursor.advance(step)


@pytest.mark.parametrize("method", ["sam", "adaptive", "rest"])
def test_greedy_output_is_unchanged_drafting_from_a_sharded_suffix_array(tiny_llama, tmp_path, method):
    """A tiny model drafting from two sa shards of its own output: plain greedy, token for token."""
    from tests.test_decode_greedy import hf_greedy, prompts, run

    vocab = tiny_llama.config.vocab_size
    for i, prompt in enumerate(prompts(vocab)[:2]):
        expected = hf_greedy(tiny_llama, prompt, 60, eos=None)
        tokens = np.asarray(expected[:40], dtype=np.int32)
        offsets = np.array([0, 25, 40])
        sharded = build_sharded(tmp_path / f"s{i}.samd", tokens, offsets, 2, vocab=vocab)
        result = run(tiny_llama, method, prompt, 60, static=sharded.structure)
        assert result.tokens == expected, (method, prompt)
        assert result.metrics.accepted > 0, method


def test_build_info_query_and_a_damaged_shard_on_the_command_line(tmp_path):
    (tmp_path / "docs").mkdir()
    for i in range(4):
        (tmp_path / "docs" / f"{i}.py").write_text(f"# file {i}\n" + CODE * (i + 1))
    answers = {}
    for out, extra in (("one.sa", []), ("s.samd", ["--shards", "2", "--workers", "2", "--memory-limit", "256M"])):
        proc = _samctl("build", str(tmp_path / "docs"), "-o", str(tmp_path / out), "--kind", "sa", "--tokenizer",
                       "bytes", *extra)
        assert proc.returncode == 0, proc.stderr
        query = _samctl("query", str(tmp_path / out), "--text", "# file 2\ndef add(a, b", "--json")
        assert query.returncode == 0, query.stderr
        answers[out] = json.loads(query.stdout)
    assert "2 shards" in proc.stdout and "suffixes" in proc.stdout, proc.stdout
    assert answers["one.sa"] == answers["s.samd"] and answers["one.sa"]["match_length"] == len("# file 2\ndef add(a, b")
    info = json.loads(_samctl("info", str(tmp_path / "s.samd"), "--json", "--verify").stdout)
    assert info["kind"] == "sa" and info["verified"] and [s["file"] for s in info["shards"]] == ["shard-00000.sa",
                                                                                              "shard-00001.sa"]
    assert info["suffixes"] == sum(s["suffixes"] for s in info["shards"]) == info["tokens"] + 4
    assert "sa (suffix array)" in _samctl("info", str(tmp_path / "s.samd")).stdout
    table = tmp_path / "s.samd" / "shard-00001.sa" / "table.0"
    table.write_bytes(table.read_bytes()[:-1])
    for args in (["info", str(tmp_path / "s.samd")], ["query", str(tmp_path / "s.samd"), "--text", "def"]):
        proc = _samctl(*args)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert "shard-00001.sa" in proc.stderr and "damaged" in proc.stderr, proc.stderr


def test_damaged_missing_or_foreign_sa_shards_are_refused_in_one_line(tmp_path):
    from samctl.index.sharded import MANIFEST

    tokens, offsets = corpus(4, n_docs=6)
    path = tmp_path / "s.samd"
    build_sharded(path, tokens, offsets, 2)
    other = tmp_path / "other.sa"
    build_suffix_array(other, tokens[:offsets[3]], offsets[:4], meta(tokens[:offsets[3]], offsets[:4], 5),
                       memory_limit=64 << 20)

    def damaged(name: str):
        target = tmp_path / name
        shutil.copytree(path, target)
        return target

    truncated = damaged("truncated.samd")
    with open(truncated / "shard-00001.sa" / "table.0", "r+b") as f:
        f.truncate(os.path.getsize(truncated / "shard-00001.sa" / "table.0") - 1)
    missing = damaged("missing.samd")
    shutil.rmtree(missing / "shard-00000.sa")
    foreign = damaged("foreign.samd")
    shutil.rmtree(foreign / "shard-00000.sa")
    shutil.copytree(other, foreign / "shard-00000.sa")
    renamed = damaged("renamed.samd")
    manifest = json.loads((renamed / MANIFEST).read_text())
    manifest["shards"][0]["file"] = "shard-00000.sam"
    (renamed / MANIFEST).write_text(json.dumps(manifest))
    for store, message in ((truncated, "shard-00001.sa has"), (missing, "lacks shard shard-00000.sa"),
                           (foreign, "shard-00000.sa (has|holds)"), (renamed, "shard file name")):
        with pytest.raises(StoreError, match=message) as err:
            load_datastore(store)
        assert "\n" not in str(err.value)
    flipped = damaged("flipped.samd")
    data = flipped / "shard-00001.sa" / "tokenized.0"
    data.write_bytes(bytes([data.read_bytes()[0] ^ 1]) + data.read_bytes()[1:])
    load_datastore(flipped)  # sizes agree: only the checksum tells
    with pytest.raises(StoreError, match="shard-00001.sa/tokenized.0 does not match its checksum"):
        load_datastore(flipped, verify=True)


def test_shards_sorted_at_once_share_the_memory_limit():
    from samctl.commands.build import _shared_memory

    assert _shared_memory(1 << 30, 4) == (4, 256 << 20)
    assert _shared_memory(256 << 20, 8) == (4, 64 << 20)  # each sort keeps the indexer's minimum
    with pytest.raises(Exception, match="at least 64 MiB"):
        _shared_memory(1 << 20, 2)

"""`samctl build`, `info`, `query`: end to end on tiny corpora with the byte-level tokenizer."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

from samctl.index.load import load_datastore
from samctl.index.store import FORMAT_VERSION, StoreError, read_store
from samctl import tokenizer as tokenizer_module
from samctl.cli import cli, main
from samctl.tokenizer import ByteTokenizer, load_tokenizer, tokenize_documents

ALPACA = [
    {"instruction": "Reverse a list in Python.", "input": "",
     "output": "def reverse(items):\n    return items[::-1]"},
    {"instruction": "Add two numbers.", "input": "2 and 3", "output": "The sum is 5."},
]
GSM8K = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
     "answer": "Tom has 3 + 4 = 7 apples.\n#### 7"},
]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.delenv("SAMCTL_DEBUG", raising=False)


@pytest.fixture
def corpus(tmp_path):
    docs = tmp_path / "docs"
    (docs / "src").mkdir(parents=True)
    (docs / "readme.md").write_text("The quick brown fox jumps over the lazy dog.\n")
    (docs / "src" / "util.py").write_text("def reverse(items):\n    return list(reversed(items))\n")
    (docs / "src" / "blob.txt").write_bytes(b"\x00\x01\x02")
    alpaca = tmp_path / "alpaca.jsonl"
    alpaca.write_text("".join(json.dumps(r) + "\n" for r in ALPACA))
    gsm8k = tmp_path / "gsm8k.json"
    gsm8k.write_text(json.dumps(GSM8K))
    return tmp_path, [str(docs), str(alpaca), str(gsm8k)]


def _invoke(args, input=None):
    result = CliRunner().invoke(cli, args, input=input, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def _main(args, capsys) -> tuple[int, str, str]:
    """Run the real entry point (error boundary included); (exit status, stdout, stderr)."""
    with pytest.raises(SystemExit) as info:
        main(args)
        raise SystemExit(0)
    out, err = capsys.readouterr()
    return info.value.code, out, err


def _documents_as_ids(texts) -> list[list[int]]:
    tok = ByteTokenizer()
    return [tok.encode(t) + [256] for t in texts]


def _occurs(needle: list[int], documents: list[list[int]]) -> bool:
    n = len(needle)
    return any(doc[i : i + n] == needle for doc in documents for i in range(len(doc) - n + 1))


def test_build_info_query_sam(corpus):
    tmp, inputs = corpus
    store = tmp / "s.sam"
    result = _invoke(["build", *inputs, "-o", str(store), "--tokenizer", "bytes"])
    assert "wrote" in result.stdout and "5 documents" in result.stdout
    assert "skipped 1 file(s)" in result.stderr and "(binary or not UTF-8)" in result.stderr

    report = json.loads(_invoke(["info", str(store), "--json", "--verify"]).stdout)
    assert report["kind"] == "sam" and report["format_version"] == FORMAT_VERSION
    assert report["documents"] == 5 and report["verified"] is True
    assert report["tokenizer"]["name"] == "bytes" and report["tokenizer"]["vocab_size"] == 257
    assert report["corpus"]["skipped_files"] == 1 and report["corpus"]["files"] == 5
    assert report["states"] > report["tokens"] // 2 and report["file_size"] == os.path.getsize(store)
    assert report["build"]["append_eos"] is True
    assert not {"max_n", "min_count", "top_k"} & set(report["build"])  # n-gram settings: not an automaton's
    described = _invoke(["info", str(store)]).stdout
    assert "sam (suffix automaton)" in described and "max_n" not in described

    answer = json.loads(_invoke(["query", str(store), "--text", "Please reverse(items):",
                                 "-n", "12", "--json"]).stdout)
    assert answer["matched_text"] == " reverse(items):"
    assert answer["count"] == 2  # in util.py and in the Alpaca answer
    assert answer["continuation_text"] == "\n    return "
    assert answer["continuation_ids"] == ByteTokenizer().encode("\n    return ")
    text = _invoke(["query", str(store), "--text", "the lazy"]).stdout
    assert '" dog.\\n"' in text and "match" in text


def test_query_matches_a_naive_search(corpus):
    """Longest suffix found in one document; the continuation follows it there."""
    tmp, inputs = corpus
    store = tmp / "s.sam"
    _invoke(["build", *inputs, "-o", str(store), "--tokenizer", "bytes", "-q"])
    texts = [
        "The quick brown fox jumps over the lazy dog.\n",
        "def reverse(items):\n    return list(reversed(items))\n",
        *("\n".join(p for p in (r["instruction"], r["input"], r["output"]) if p) for r in ALPACA),
        *(r["question"] + "\n" + r["answer"] for r in GSM8K),
    ]
    documents = _documents_as_ids(texts)
    rng = np.random.default_rng(0)
    for trial in range(30):
        doc = documents[trial % len(documents)]
        start = int(rng.integers(0, len(doc) - 1))
        query = [int(x) for x in rng.integers(0, 256, 3)] + doc[start : start + int(rng.integers(1, 12))]
        ids = ",".join(map(str, query))
        answer = json.loads(_invoke(["query", str(store), "--ids", ids, "-n", "8", "--json"]).stdout)
        m = answer["match_length"]
        assert _occurs(query[len(query) - m :], documents)
        assert m == len(query) or not _occurs(query[len(query) - m - 1 :], documents)
        assert _occurs(answer["matched_ids"] + answer["continuation_ids"], documents)


def test_build_ngram_and_query(corpus):
    tmp, inputs = corpus
    store = tmp / "n.sam"
    result = _invoke(["build", *inputs, "-o", str(store), "--tokenizer", "bytes", "--kind", "ngram",
                      "--max-n", "3", "--min-count", "1", "--top-k", "4"])
    assert "contexts" in result.stdout
    report = json.loads(_invoke(["info", str(store), "--json"]).stdout)
    assert report["kind"] == "ngram" and report["entries"] > 0
    assert report["build"]["max_n"] == 3 and report["build"]["top_k"] == 4
    answer = json.loads(_invoke(["query", str(store), "--text", "the laz", "--json"]).stdout)
    assert answer["match_length"] == 3
    assert answer["continuation_text"].startswith("y do")  # greedy chain over 3-grams
    assert answer["next_tokens"][0]["text"] == "y"


@pytest.mark.parametrize("compress", ["--compress", "--no-compress"])
def test_compressed_and_raw_stores_answer_alike(corpus, compress):
    tmp, inputs = corpus
    store = tmp / "s.sam"
    _invoke(["build", *inputs, "-o", str(store), "--tokenizer", "bytes", compress, "--verify", "-q"])
    codecs = {e.codec for e in read_store(store).entries.values()}
    assert codecs == {"raw"} if compress == "--no-compress" else "zstd" in codecs
    answer = json.loads(_invoke(["query", str(store), "--text", "Tom has 3", "--json"]).stdout)
    assert answer["continuation_text"].startswith(" apples and buys")


def test_build_from_stdin_jsonl_and_plain_text(tmp_path):
    store = tmp_path / "s.sam"
    lines = "".join(json.dumps(r) + "\n" for r in GSM8K + ALPACA)
    _invoke(["build", "-", "-o", str(store), "--tokenizer", "bytes", "-q"], input=lines)
    assert load_datastore(store).meta.corpus.documents == 3
    _invoke(["build", "-", "-o", str(store), "--tokenizer", "bytes", "-q"], input="just text\n")
    loaded = load_datastore(store)
    assert loaded.meta.corpus.documents == 1 and loaded.meta.corpus.inputs == ("-",)


def test_field_option(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"body": "hello world", "id": 3}) + "\n")
    store = tmp_path / "s.sam"
    _invoke(["build", str(data), "--field", "body", "-o", str(store), "--tokenizer", "bytes", "-q"])
    assert load_datastore(store).meta.build.fields == ("body",)


def test_default_tokenizer_is_announced(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tokenizer_module, "DEFAULT_MODEL_DIR", tmp_path / "missing")
    (tmp_path / "a.txt").write_text("hello")
    code, _out, err = _main(["build", str(tmp_path / "a.txt"), "-o", str(tmp_path / "s.sam")], capsys)
    assert code == 0
    assert "using the byte-level tokenizer" in err
    assert load_datastore(tmp_path / "s.sam").meta.tokenizer_name == "bytes"
    code, out, err = _main(["build", str(tmp_path / "a.txt"), "-o", str(tmp_path / "s.sam"), "-q"], capsys)
    assert (code, out, err) == (0, "", "")  # --quiet: no note either


# ---------------------------------------------------------------------------------------------
# errors: one line, exit status 2


def _one_line_error(code: int, err: str) -> str:
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("samctl: error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_empty_corpus_is_refused(tmp_path, capsys):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "blank.txt").write_text("   \n")
    code, _out, err = _main(["build", str(tmp_path / "docs"), "-o", str(tmp_path / "s.sam"),
                             "--tokenizer", "bytes"], capsys)
    assert "corpus is empty" in _one_line_error(code, err)
    assert not (tmp_path / "s.sam").exists()


@pytest.fixture
def built(corpus):
    tmp, inputs = corpus
    store = tmp / "s.sam"
    _invoke(["build", *inputs, "-o", str(store), "--tokenizer", "bytes", "-q"])
    return store


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: b"NOTASTORE" + d[9:], "wrong magic"),
        (lambda d: d[: len(d) // 2], "truncated"),
        (lambda d: d[:10], "truncated"),
        (lambda d: d[:8] + (FORMAT_VERSION + 1).to_bytes(4, "little") + d[12:], "upgrade samctl"),
        (lambda d: d[:40] + bytes([d[40] ^ 0xFF]) + d[41:], "corrupt header"),
        (lambda d: b"", "empty"),
    ],
)
@pytest.mark.parametrize("command", [["info"], ["query", "--text", "x"]])
def test_damaged_store(built, capsys, damage, message, command):
    built.write_bytes(damage(built.read_bytes()))
    code, _out, err = _main([command[0], str(built), *command[1:]], capsys)
    assert message in _one_line_error(code, err)


def test_debug_shows_the_traceback(built, monkeypatch):
    built.write_bytes(b"garbage")
    monkeypatch.setenv("SAMCTL_DEBUG", "1")
    with pytest.raises(StoreError):
        main(["info", str(built)])


@pytest.mark.parametrize("command", [["info"], ["serve", "--sam"]])
def test_missing_store(tmp_path, capsys, command):
    # every command words a missing store alike (serve checks its stores before loading the model)
    code, _out, err = _main([*command, str(tmp_path / "nope.sam")], capsys)
    assert "nope.sam does not exist: build one with samctl build" in _one_line_error(code, err)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ids", "1,x"], "not a list of integers"),
        (["--ids", "1,999"], "outside the store's vocabulary"),
        ([], "exactly one of --text or --ids"),
        (["--text", "a", "--ids", "1"], "exactly one of --text or --ids"),
    ],
)
def test_query_argument_errors(built, capsys, args, message):
    code, _out, err = _main(["query", str(built), *args], capsys)
    assert message in _one_line_error(code, err)


def test_interrupted_build_keeps_the_old_store(built, monkeypatch, capsys):
    import samctl.index.store

    old = built.read_bytes()

    def interrupt(_fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(samctl.index.store.os, "fsync", interrupt)
    code, _out, _err = _main(["build", str(built.parent / "alpaca.jsonl"), "-o", str(built),
                              "--tokenizer", "bytes", "-q"], capsys)
    assert code == 130
    assert built.read_bytes() == old
    assert not [p for p in os.listdir(built.parent) if ".tmp" in p]


def test_offline_dataset_error_is_clean(tmp_path, capsys):
    pytest.importorskip("datasets")
    code, _out, err = _main(["build", "hf:no-such-org/no-such-dataset", "-o",
                             str(tmp_path / "s.sam"), "--tokenizer", "bytes"], capsys)
    assert "no-such-org/no-such-dataset" in _one_line_error(code, err)


def test_bad_build_options(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("x")
    for n, said in (("0", "--max-n must be in 1..16, got 0"), ("20", "--max-n must be at most 16, got 20")):
        code, _out, err = _main(["build", str(tmp_path / "a.txt"), "-o", str(tmp_path / "s.sam"),
                                 "--kind", "ngram", "--max-n", n, "--tokenizer", "bytes"], capsys)
        assert said in _one_line_error(code, err)  # the table's own bound, worded as the flag
    for kind in ("sam", "sa"):  # the n-gram settings given for another kind are refused, not ignored
        code, _out, err = _main(["build", str(tmp_path / "a.txt"), "-o", str(tmp_path / "s.sam"), "--kind", kind,
                                 "--max-n", "3", "--top-k", "4", "--tokenizer", "bytes"], capsys)
        assert "no n-gram settings: drop --max-n and --top-k, or add --kind ngram" in _one_line_error(code, err)
    code, _out, err = _main(["build", str(tmp_path / "a.txt"), "-o", str(tmp_path / "s.sam"),
                             "--tokenizer", "./no/such/folder"], capsys)
    assert "does not exist" in _one_line_error(code, err)


# ---------------------------------------------------------------------------------------------
# a real (tiny) Hugging Face tokenizer


@pytest.fixture(scope="module")
def bpe_folder(tmp_path_factory):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    folder = tmp_path_factory.mktemp("bpe")
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>").save_pretrained(folder)
    return folder


def test_hf_tokenizer_build_and_query(tmp_path, bpe_folder, capsys):
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog")
    store = tmp_path / "s.sam"
    _invoke(["build", str(tmp_path / "a.txt"), "-o", str(store), "--tokenizer", str(bpe_folder), "-q"])
    tok = load_tokenizer(str(bpe_folder))
    meta = load_datastore(store).meta
    assert meta.tokenizer_name == str(bpe_folder.resolve())
    assert meta.tokenizer_fingerprint == tok.fingerprint and meta.vocab_size == tok.vocab_size
    assert meta.eos_token_id == tok.eos_token_ids[0]

    answer = json.loads(_invoke(["query", str(store), "--text", "over the", "--json"]).stdout)
    assert answer["continuation_text"].startswith(" lazy dog")
    assert answer["continuation_ids"][-1] == meta.eos_token_id

    code, _out, err = _main(["query", str(store), "--text", "x", "--tokenizer", "bytes"], capsys)
    line = _one_line_error(code, err)
    assert "was built with tokenizer" in line and "--tokenizer bytes" in line


def test_tokenizer_fingerprint_is_stable_and_distinguishes(bpe_folder):
    first, second = load_tokenizer(str(bpe_folder)), load_tokenizer(str(bpe_folder))
    assert first.fingerprint == second.fingerprint != ByteTokenizer.fingerprint
    assert first.encode_batch(["the fox", "lazy"]) == [first.encode("the fox"), first.encode("lazy")]


def test_tokenize_documents_offsets_and_eos():
    tokens, offsets = tokenize_documents(["ab", "", "c"], ByteTokenizer(), batch_chars=2)
    assert tokens.tolist() == [97, 98, 256, 256, 99, 256]
    assert offsets.tolist() == [0, 3, 4, 6]
    tokens, offsets = tokenize_documents(["ab", "c"], ByteTokenizer(), append_eos=False)
    assert tokens.tolist() == [97, 98, 99] and offsets.tolist() == [0, 2, 3]


def test_build_append_to_equals_full_build(corpus, tmp_path, capsys):
    root, inputs = corpus
    old, grown, full = (str(tmp_path / name) for name in ("old.sam", "grown.sam", "full.sam"))
    _invoke(["build", inputs[0], "-o", old, "--tokenizer", "bytes", "-q"])
    _invoke(["build", "--append-to", old, *inputs[1:], "-o", grown, "-q"])
    _invoke(["build", *inputs, "-o", full, "--tokenizer", "bytes", "-q"])
    a, b = load_datastore(grown), load_datastore(full)
    for name in ("states", "edges", "tokens"):
        assert np.array_equal(a.structure.to_arrays()[name], b.structure.to_arrays()[name])
    assert (a.meta.corpus.documents, a.meta.corpus.tokens) == (b.meta.corpus.documents, b.meta.corpus.tokens)
    assert a.meta.corpus.inputs == tuple(inputs)
    # growing in place, and refusing an n-gram store
    _invoke(["build", "--append-to", grown, inputs[2], "-o", grown, "-q"])
    assert load_datastore(grown).meta.corpus.documents == b.meta.corpus.documents + 1
    ngram = str(tmp_path / "n.sam")
    _invoke(["build", inputs[0], "-o", ngram, "--kind", "ngram", "--tokenizer", "bytes", "-q"])
    status, _, err = _main(["build", "--append-to", ngram, inputs[1], "-o", grown], capsys)
    assert status == 2 and "an ngram store" in err and err.count("\n") == 1

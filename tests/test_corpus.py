"""Corpus readers: folders, record files in known shapes, stdin, datasets; clear errors."""
from __future__ import annotations

import io
import json

import pytest

from samctl.index.corpus import CorpusReader, record_text
from samctl.index.errors import UserError


def _texts(*args, **kwargs) -> list[str]:
    return [d.text for d in CorpusReader(*args, **kwargs)]


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "b.txt").write_text("beta")
    (root / "a.md").write_text("# alpha")
    (root / "sub" / "code.py").write_text("print('hi')\n")
    (root / "sub" / "data.bin").write_bytes(b"\x00\x01binary")
    (root / "sub" / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (root / "sub" / "blank.txt").write_text("  \n")
    (root / "sub" / "notes.log").write_text("a log")
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main")
    (root / ".hidden.txt").write_text("hidden")
    return root


def test_folder_reads_text_files_in_sorted_order(folder):
    reader = CorpusReader([str(folder)])
    documents = list(reader)
    assert [d.text for d in documents] == ["# alpha", "beta", "print('hi')\n"]
    assert documents[0].source.endswith("a.md")
    assert reader.counts.documents == 3
    assert reader.counts.empty == 1  # blank.txt
    # latin1.txt is selected by extension but not UTF-8; data.bin is not selected at all.
    assert [p.rsplit("/", 1)[-1] for p in reader.counts.skipped] == ["latin1.txt (binary or not UTF-8)"]
    assert reader.counts.characters == sum(len(d.text) for d in documents)


def test_include_replaces_extensions_and_exclude_removes(folder):
    assert _texts([str(folder)], include=["*.log", "*.bin"]) == ["a log"]
    assert _texts([str(folder)], exclude=["sub/*"]) == ["# alpha", "beta"]
    assert _texts([str(folder)], exclude=["*.md"]) == ["beta", "print('hi')\n"]


def test_explicit_text_file_and_binary_error(folder):
    assert _texts([str(folder / "sub" / "notes.log")]) == ["a log"]
    with pytest.raises(UserError, match="binary or not UTF-8"):
        _texts([str(folder / "sub" / "data.bin")])


def test_missing_input_and_no_input(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        CorpusReader([str(tmp_path / "nope")])
    with pytest.raises(UserError, match="no input"):
        CorpusReader([])


ALPACA = {"instruction": "Add two numbers.", "input": "2 and 3", "output": "5"}
GSM8K = {"question": "What is 2+2?", "answer": "2+2=4\n#### 4"}
SPECBENCH = {"question_id": 1, "category": "writing", "turns": ["Write a poem.", "Shorter."]}


def test_jsonl_shapes(tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [ALPACA, {"instruction": "Say hi.", "input": "", "output": "hi"}, GSM8K, SPECBENCH,
            {"text": "plain"}, {**SPECBENCH, "reference": ["A poem.", "Short."]},
            {"messages": [{"role": "user", "content": "hey"}, {"role": "assistant", "content": "yo"}]},
            {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
            {"instruction": "X", "response": "Y"}, {"prompt": "P", "completion": "C"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert _texts([str(path)]) == [
        "Add two numbers.\n2 and 3\n5",
        "Say hi.\nhi",
        "What is 2+2?\n2+2=4\n#### 4",
        "Write a poem.\nShorter.",
        "plain",
        "Write a poem.\nShorter.\nA poem.\nShort.",
        "hey\nyo",
        "q\na",
        "X\nY",
        "P\nC",
    ]
    sources = [d.source for d in CorpusReader([str(path)])]
    assert sources[0].endswith("data.jsonl line 1") and sources[2].endswith("line 3")


def test_json_list_single_object_and_json_lines(tmp_path):
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps([ALPACA, GSM8K], indent=2))
    single = tmp_path / "one.json"
    single.write_text(json.dumps(GSM8K))
    lines = tmp_path / "lines.json"
    lines.write_text(json.dumps(ALPACA) + "\n" + json.dumps(GSM8K) + "\n")
    expected = ["Add two numbers.\n2 and 3\n5", "What is 2+2?\n2+2=4\n#### 4"]
    assert _texts([str(listed)]) == expected
    assert _texts([str(lines)]) == expected
    assert _texts([str(single)]) == expected[1:]


def test_user_fields(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"body": "B", "title": "T", "n": 3}) + "\n"
                    + json.dumps({"title": "only title"}) + "\n")
    assert _texts([str(path)], fields=["title", "body"]) == ["T\nB", "only title"]
    with pytest.raises(UserError, match="line 2 has none of the fields n"):
        _texts([str(path)], fields=["n"])


def test_unknown_record_names_file_line_and_the_fields_argument(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(GSM8K) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(UserError, match=r"data.jsonl line 2 has no known text fields \(it has body\).*fields="):
        _texts([str(path)])
    with pytest.raises(UserError, match=r"line 1 has none of the fields zz.*fields="):
        _texts([str(path)], fields=["zz"])


@pytest.mark.parametrize(
    "content, match",
    [
        ('{"text": "a"}\n{oops\n', "line 2 is not valid JSON"),
        ('[1, 2]\n', "is a list, not a JSON object"),
    ],
)
def test_malformed_records(tmp_path, content, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(UserError, match=match):
        _texts([str(path)])


def test_records_without_text_are_skipped_and_nested_lists_read(tmp_path, caplog):
    # Spec-Bench's rag records hold a list of answer lists per turn: read, flattened. A record
    # whose field holds no text is left out, counted and noted; the rest are read.
    path = tmp_path / "mixed.jsonl"
    rows = [{"turns": ["Who?"], "reference": [["Ray", "Harrison"]]}, {"text": {"nested": 1}},
            {"turns": [{"x": 1}]}, {"text": "kept"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reader = CorpusReader([str(path)])
    with caplog.at_level("WARNING", logger="samctl"):
        assert [d.text for d in reader] == ["Who?\nRay\nHarrison", "kept"]
    assert [s.split(": ", 1)[1] for s in reader.counts.skipped_records] == [
        "field 'text' is a dict, not text", "field 'turns' holds a dict that is not text"]
    assert "skipped 2 record(s)" in caplog.text and "mixed.jsonl line 2" in caplog.text
    prompts = CorpusReader([str(path)], prompts=True)
    assert [d.turns for d in prompts] == [("Who?",), ("kept",)] and len(prompts.counts.skipped_records) == 2


def test_a_record_whose_text_field_is_null_is_skipped(tmp_path):
    # as a field holding a dict: noted and left out, where it ended the whole build
    path = tmp_path / "nulls.jsonl"
    path.write_text('{"text": null}\n{"text": "kept"}\n{"prompt": null, "text": null}\n')
    for reader in (CorpusReader([str(path)]), CorpusReader([str(path)], prompts=True),
                   CorpusReader([str(path)], fields=("text",))):
        assert [d.text if not reader.prompts else d.turns for d in reader] in (["kept"], [("kept",)])
        assert "field 'text' is null, not text" in reader.counts.skipped_records[0]


def test_invalid_json_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[{"text": "a"},')
    with pytest.raises(UserError, match="bad.json is not valid JSON"):
        _texts([str(path)])


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist([GSM8K, {"question": "Q2", "answer": "A2"}]), path)
    assert _texts([str(path)]) == ["What is 2+2?\n2+2=4\n#### 4", "Q2\nA2"]
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet at all")
    with pytest.raises(UserError, match="cannot read .*broken.parquet as Parquet"):
        _texts([str(broken)])


def test_stdin_json_lines_and_plain_text():
    jsonl = io.StringIO("\n" + json.dumps(ALPACA) + "\n" + json.dumps({"text": "t"}) + "\n")
    documents = list(CorpusReader(["-"], stdin=jsonl))
    assert [d.text for d in documents] == ["Add two numbers.\n2 and 3\n5", "t"]
    assert documents[0].source == "<stdin> line 2"
    plain = io.StringIO("just some text\n{not json\nmore\n")
    assert _texts(["-"], stdin=plain) == ["just some text\n{not json\nmore"]
    with pytest.raises(UserError, match="only once"):
        CorpusReader(["-", "-"])


def test_hf_spec_errors(monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="not a dataset spec"):
        _texts(["hf:"])
    with pytest.raises(UserError, match=r"cannot load dataset 'no-such/dataset-zz'"):
        _texts(["hf:no-such/dataset-zz:train"])


def test_hf_saved_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    single = tmp_path / "single"
    datasets.Dataset.from_list([GSM8K, {"question": "Q2", "answer": None}]).save_to_disk(str(single))
    assert _texts([f"hf:{single}"]) == ["What is 2+2?\n2+2=4\n#### 4", "Q2"]
    splits = tmp_path / "splits"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_list([{"text": "train row"}]),
        "test": datasets.Dataset.from_list([{"text": "test row"}]),
    }).save_to_disk(str(splits))
    assert _texts([f"hf:{splits}"]) == ["train row"]
    assert _texts([f"hf:{splits}:test"]) == ["test row"]
    with pytest.raises(UserError, match="no split 'dev'"):
        _texts([f"hf:{splits}:dev"])


def test_record_text_prefers_named_fields():
    assert record_text({"text": "t", "question": "q"}, ("text",), "r") == "t"
    assert record_text({"text": "t", "question": "q"}, (), "r") == "q"


def test_prompts_carry_the_records_own_answer(tmp_path):
    from samctl.index.corpus import iter_prompts

    rows = [{"instruction": "Sort", "input": "3 1 2", "output": "1 2 3"}, {"question": "2+2?", "answer": "4"},
            {"prompt": "Say hi", "completion": "hi"}, {"instruction": "No answer"},
            {"turns": ["Write.", "Shorter."], "reference": ["r1", "r2"]}, {"text": "just text"}]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "d.txt").write_text("A document.")
    docs = list(iter_prompts([str(path), str(tmp_path / "d.txt")]))
    assert [(d.turns, d.answer) for d in docs] == [
        (("Sort\n\n3 1 2",), "1 2 3"), (("2+2?",), "4"), (("Say hi",), "hi"), (("No answer",), ""),
        (("Write.", "Shorter."), ""), (("just text",), ""), (("A document.",), "")]
    (tmp_path / "q.jsonl").write_text(json.dumps(rows[1]) + "\n")
    assert [d.answer for d in iter_prompts([str(tmp_path / "q.jsonl")], fields=("question",))] == [""]  # named fields
    assert all(d.answer == "" for d in CorpusReader([str(path)]))  # read as a corpus, answers are in the text


@pytest.mark.parametrize("record, match", [({"body": "x"}, "has no known prompt fields"),
                                           ({"messages": [{"role": "system", "content": "s"}]}, "has no user message")])
def test_prompt_shape_errors_name_the_fields_setting(tmp_path, record, match):
    from samctl.index.corpus import iter_prompts

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(UserError, match=match + r".*name the fields to read with fields=$"):
        list(iter_prompts([str(path)]))


def test_hf_hub_retry_warnings_stay_off_stderr(monkeypatch, capfd):
    datasets = pytest.importorskip("datasets")
    from huggingface_hub.utils import logging as hub_logging

    def offline(*_args, **_kwargs):
        hub_logging.get_logger("huggingface_hub.utils._http").warning("'[Errno -2]' thrown while requesting HEAD")
        raise OSError("Couldn't reach the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    level = hub_logging.get_verbosity()
    try:
        with pytest.raises(UserError, match="cannot load dataset 'some/dataset'"):
            _texts(["hf:some/dataset"])
    finally:
        hub_logging.set_verbosity(level)
    assert "thrown while requesting" not in capfd.readouterr().err

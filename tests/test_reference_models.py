"""The embedded default models (samctl/models/default) and the tool that trains them.

The shipped models must load offline the way users load them, share one tokenizer, fit the size
budget and stop on EOS. The training tool runs end to end on a tiny corpus written here (no
/work/shared, no stdlib scan), and the same seed gives the same losses.
"""
from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parent.parent
DEFAULT = REPO / "samctl" / "models" / "default"
MAX_BYTES = 20 * 1024 * 1024


def _load_tool():
    spec = importlib.util.spec_from_file_location("train_reference", REPO / "tools" / "train_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_reference"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


tool = _load_tool()


# -- the embedded default --------------------------------------------------------------------


def test_default_fits_size_budget():
    files = [p for p in DEFAULT.rglob("*") if p.is_file()]
    assert files, f"no embedded default models under {DEFAULT}"
    total = sum(p.stat().st_size for p in files)
    assert total <= MAX_BYTES, f"embedded default is {total / 2**20:.1f} MiB > 20 MiB"


@pytest.fixture(scope="module")
def default_models():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = {}
    for name in ("target", "draft"):
        folder = DEFAULT / name
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        out[name] = (model.eval(), AutoTokenizer.from_pretrained(folder))
    return out


def test_default_loads_as_float32_llama(default_models):
    for name, (model, _) in default_models.items():
        assert model.config.model_type == "llama", name
        assert model.dtype == torch.float32, name
        assert model.config.max_position_embeddings >= 1024, name
        assert model.config.tie_word_embeddings, name


def test_target_and_draft_share_tokenizer(default_models):
    (target, t_tok), (draft, d_tok) = default_models["target"], default_models["draft"]
    assert t_tok.get_vocab() == d_tok.get_vocab()
    assert target.config.vocab_size == draft.config.vocab_size == len(t_tok)
    assert sum(p.numel() for p in draft.parameters()) * 3 < sum(p.numel() for p in target.parameters())
    text = "def f(x):\n    return x + 1\n"
    assert t_tok(text).input_ids == d_tok(text).input_ids
    assert t_tok.decode(t_tok(text).input_ids) == text


def test_generation_config_has_eos(default_models):
    for name, (model, tok) in default_models.items():
        eos = model.generation_config.eos_token_id
        assert eos is not None and eos == tok.eos_token_id, name
        assert tok.pad_token_id == tok.eos_token_id, name


def test_chat_template_matches_training_format(default_models):
    _, tok = default_models["target"]
    messages = [{"role": "user", "content": "Summarize this."}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == tool.instruction_prompt("Summarize this.")
    turn = tok.apply_chat_template(messages + [{"role": "assistant", "content": "Done."}], tokenize=False)
    assert turn.startswith(rendered) and "Done." + tok.eos_token in turn


def test_target_copies_from_prompt(default_models):
    """Greedy answer to an unseen quoting question: a sentence copied verbatim, then EOS."""
    model, tok = default_models["target"]
    passage = ("It was a calm day. The quick brown fox jumps over the lazy dog near the river bank. "
               "Nobody saw it happen.")
    prompt = tool.instruction_prompt(
        f"Answer the question by quoting the passage.\n\nPassage:\n{passage}\n\n"
        "Question: What does the passage say about river?")
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=40, do_sample=False)
    new = out[0, ids.shape[1]:].tolist()
    assert tok.eos_token_id in new, tok.decode(new)
    answer = tok.decode(new[:new.index(tok.eos_token_id)])
    assert len(answer.split()) >= 4 and answer in passage, answer


# -- building blocks of the tool ---------------------------------------------------------------

CODE = '''def area(width, height):
    size = width * height
    return size


def perimeter(width, height):
    return 2 * (width + height)


LIMIT = 10
'''


def test_edit_rename_replaces_every_occurrence():
    rng = random.Random(0)
    change, edited = tool.edit_rename(CODE, rng)
    old, new = change.split("`")[1], change.split("`")[3]
    assert edited == re.sub(rf"\b{old}\b", new, CODE)
    assert old in CODE and new in edited


def test_edit_delete_function_removes_the_whole_def():
    for seed in range(10):
        change, edited = tool.edit_delete_function(CODE, random.Random(seed))
        name = change.split("`")[1]
        assert f"def {name}" not in edited
        assert edited.count("def ") == 1 and "LIMIT = 10" in edited


def test_edit_change_constant_changes_one_number():
    change, edited = tool.edit_change_constant(CODE, random.Random(3))
    diff = [(a, b) for a, b in zip(CODE.splitlines(), edited.splitlines()) if a != b]
    assert len(diff) == 1 and len(CODE.splitlines()) == len(edited.splitlines())


def test_summary_is_a_prefix_of_the_document():
    doc = tool.Document("doc/x", " ".join(f"Sentence number {i} is here." for i in range(12)))
    for seed in range(20):
        ex = tool.make_summary(doc, random.Random(seed), 2000)
        if ex is not None:
            assert doc.text.startswith(ex.response) and ex.response.endswith(".")


def test_repeat_answer_is_in_prompt():
    code_doc = tool.Document("stdlib/m.py", CODE * 3)
    prose_doc = tool.Document("doc/x", "\n\n".join(f"Paragraph {i} says something useful." for i in range(9)))
    for doc in (code_doc, prose_doc):
        made = [tool.make_repeat(doc, random.Random(seed), 1000) for seed in range(10)]
        made = [ex for ex in made if ex is not None]
        assert made, doc.key
        for ex in made:
            assert ex.prompt.endswith(ex.response + "\n\n" + tool.RESPONSE_HEADER)


def test_pack_rows_keeps_examples_whole():
    rng = np.random.default_rng(0)
    seqs = [rng.integers(1, 50, size=int(n), dtype=np.int32) for n in rng.integers(1, 30, size=200)]
    rows, lengths = tool.pack_rows(seqs, seq_len=63, pad_id=0)
    assert rows.shape[1] == 64 and rows.dtype == np.int32
    assert int(lengths.sum()) == sum(len(s) for s in seqs)
    assert np.all(rows[np.arange(64)[None, :] >= lengths[:, None]] == 0)
    joined = b"".join(rows[r, :lengths[r]].tobytes() for r in range(len(rows)))
    for s in seqs:  # each example appears contiguously
        assert s.tobytes() in joined


def test_heldout_split_is_stable():
    keys = [f"stdlib/mod{i}.py" for i in range(2000)]
    held = [k for k in keys if tool.is_heldout(k)]
    assert held == [k for k in keys if tool.is_heldout(k)]
    assert 0.01 < len(held) / len(keys) < 0.06


# -- the tool end to end -------------------------------------------------------------------------


def _tiny_corpus(root: Path) -> tuple[Path, Path, Path]:
    code, docs, data = root / "code", root / "docs" / "pkg", root / "data"
    for folder in (code, docs, data):
        folder.mkdir(parents=True)
    for i in range(8):
        (code / f"mod{i}.py").write_text(CODE.replace("area", f"area{i}") * 3)
        paragraph = " ".join(f"The tool number {i} reads file {j} quickly." for j in range(6))
        (docs / f"notes{i}.txt").write_text("\n\n".join([paragraph] * 3))
    return code, docs.parent, data


def _run_tiny(root: Path, out: str) -> dict:
    code, docs, data = _tiny_corpus(root)
    return tool.main([
        "--out", str(root / out), "--preset", "tiny", "--max-steps", "4", "--warmup-steps", "2",
        "--stdlib-dir", str(code), "--docs-dir", str(docs), "--data-dir", str(data),
        "--data-tokens", "6000", "--checkpoint-minutes", "0",
    ])


@pytest.mark.slow
def test_tool_end_to_end_is_deterministic(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    first = _run_tiny(tmp_path / "a", "out")
    second = _run_tiny(tmp_path / "b", "out")
    for name in ("target", "draft"):
        a, b = first["models"][name], second["models"][name]
        assert a["steps"] == b["steps"] == 4
        assert a["first_train_loss"] == b["first_train_loss"]
        assert a["final_train_loss"] == b["final_train_loss"]
        assert a["heldout_loss"] == b["heldout_loss"]
        folder = tmp_path / "a" / "out" / name
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(folder)
        assert model.generation_config.eos_token_id == tok.eos_token_id
    report = json.loads((tmp_path / "a" / "out" / "train_report.json").read_text())
    assert report["command"].startswith("python tools/train_reference.py")
    assert report["mixture"]["code_edit"]["train_examples"] > 0
    assert report["mixture"]["random_repeat"]["train_tokens"] > 0

    # --init-from with --max-steps 0 reloads the saved bf16 folders and re-measures held-out loss
    root = tmp_path / "a"
    again = tool.main([
        "--out", str(root / "eval"), "--preset", "tiny", "--max-steps", "0",
        "--init-from", str(root / "out"), "--stdlib-dir", str(root / "code"),
        "--docs-dir", str(root / "docs"), "--data-dir", str(root / "data"), "--data-tokens", "6000",
    ])
    for name in ("target", "draft"):
        assert again["models"][name]["steps"] == 0
        before, after = first["models"][name]["heldout_loss"], again["models"][name]["heldout_loss"]
        assert before.keys() == after.keys() and before
        for source in before:  # bf16 rounding of the saved weights moves the loss only slightly
            assert after[source] == pytest.approx(before[source], abs=0.05), source

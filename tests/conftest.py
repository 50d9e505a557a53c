"""Shared fixtures: tiny random models saved and reloaded the way users load them, offline."""
from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Verify-cost curves measured by tests go to a throwaway cache, not the user's.
os.environ.setdefault("SAMCTL_CACHE", tempfile.mkdtemp(prefix="samctl-test-cache-"))

import pytest
import torch

# pytest -n (xdist): the workers share the cores, so each (and every command it starts) takes one
# thread; more would fight over them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


def _numba_cache() -> str:
    """Where the suite's compiled kernels go: one cache per checkout, version of the kernels' code
    and worker.

    numba's disk cache is not safe for processes compiling different signatures of one kernel at
    once: each numbers its new entry by the index it read, so an entry can name another
    signature's code, which segfaults when loaded (seen in a clean CI run). So each xdist worker
    (and the commands it starts) has its own. And numba keys a cached function on its own source
    file only: a kernel that inlines another module's (int8_forward's layers call attention's)
    would run the old code after that module changed. So the cache is per digest of decode/ and
    index/, and a checkout's caches of other digests are removed."""
    import glob
    import hashlib
    import shutil

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    checkout = hashlib.sha1(root.encode()).hexdigest()[:10]
    code = hashlib.sha1()
    for path in sorted(glob.glob(os.path.join(root, "decode", "**", "*.py"), recursive=True)
                       + glob.glob(os.path.join(root, "index", "*.py"))):
        with open(path, "rb") as f:
            code.update(f.read())
    base = os.path.join(tempfile.gettempdir(), "samctl-test-numba")
    current = f"{checkout}-{code.hexdigest()[:10]}"
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    if worker in ("gw0", "main"):
        for old in glob.glob(os.path.join(base, checkout + "*")):
            if os.path.basename(old) != current:
                shutil.rmtree(old, ignore_errors=True)
    return os.path.join(base, current, worker)


# A cache the user set stays; the one the xdist controller set, which its workers inherit, does not.
_inherited = os.environ.get("NUMBA_CACHE_DIR")
if not _inherited or _inherited.startswith(os.path.join(tempfile.gettempdir(), "samctl-test-numba")):
    os.environ["NUMBA_CACHE_DIR"] = _numba_cache()


def _tiny(arch: str, vocab: int, seed: int):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    config = LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # Random small weights give near-uniform logits; scale the head so greedy paths are stable
    # and repetitive, which is what lets retrieval drafts be accepted in tests.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model_dir(request, tmp_path_factory):
    """A tiny random model folder (config + safetensors), one per architecture."""
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    _tiny(request.param, vocab=96, seed=0).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama-main")
    _tiny("llama", vocab=96, seed=0).save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


TRAIN_TEXT = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. The dog sleeps.\n",
    "Summarize the document. The answer is in the passage above.\n",
] * 20


def save_tiny_model_with_tokenizer(path, seed: int = 0, vocab: int = 300, extra_text: str = "") -> None:
    """A byte-level BPE tokenizer trained on a few lines and a tiny random Llama of its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(TRAIN_TEXT + [extra_text], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = "{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n\n{% endfor %}### assistant:\n"
    tokenizer.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-model-tok")
    save_tiny_model_with_tokenizer(path)
    return path


def save_hub_style_tokenizer(folder, **config) -> None:
    """A byte-level BPE tokenizer folder as the Hub ships SmolLM2's: tokenizer.json beside a
    tokenizer_config.json naming GPT2Tokenizer with add_prefix_space (overridden by `config`).
    Built with the `tokenizers` library alone."""
    import json
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["The quick brown fox jumps over the lazy dog. def f(x):\n    return x\n"] * 20,
                            trainer)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    bpe.save(str(folder / "tokenizer.json"))
    settings = {"add_prefix_space": False, "bos_token": "<|endoftext|>", "clean_up_tokenization_spaces": False,
                "eos_token": "<|endoftext|>", "model_max_length": 8192, "tokenizer_class": "GPT2Tokenizer",
                "unk_token": "<|endoftext|>", **config}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))

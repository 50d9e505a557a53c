"""Streaming tokenization (samctl.tokenizer): bounded batches, huge documents cut where the
pre-tokenizer cuts anyway, and the same tokens as tokenizing every document whole."""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import save_hub_style_tokenizer
from samctl.tokenizer import (_CUT, DEFAULT_MODEL_DIR, ByteTokenizer, FastTokenizer, HFTokenizer, load_tokenizer,
                              split_text, tokenize_documents)

# Pieces that exercise the byte-level regex: runs of spaces and newlines, tabs, digits, punctuation,
# contractions, non-ASCII letters, and an added special token.
ALPHABET = ["a", "bc", "é", "Ω", " ", "  ", "\n", "\n\n", " \n", "\t", "1", "234", ".", ",", "'s", " x",
            "<|endoftext|>", "def f(x):\n    return x\n"]


def _smollm2_folder() -> Path | None:
    """SmolLM2's tokenizer folder: $SAMCTL_TEST_SMOLLM2, else the Hugging Face cache (offline)."""
    import os

    if os.environ.get("SAMCTL_TEST_SMOLLM2"):
        return Path(os.environ["SAMCTL_TEST_SMOLLM2"])
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache("HuggingFaceTB/SmolLM2-135M-Instruct", "tokenizer.json")
    return Path(found).parent if isinstance(found, str) else None


def _random_texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 60))) for _ in range(count)]


def _whole(texts: list[str], tokenizer) -> list[int]:
    """The naive reference: every document tokenized in one call, EOS after each."""
    eos = list(tokenizer.eos_token_ids[:1])
    return [t for text in texts for t in tokenizer.encode(text) + eos]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer folder as transformers saves one (no model weights)."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["def f(x):\n    return x  # the quick brown fox, 1234.\n"] * 20, trainer)
    folder = tmp_path_factory.mktemp("tok")
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(folder)
    return folder


def _tokenizers(tiny_folder: Path) -> list:
    found = [ByteTokenizer(), load_tokenizer(str(tiny_folder))]
    if DEFAULT_MODEL_DIR.is_dir():
        found.append(load_tokenizer("default"))
    smollm2 = _smollm2_folder()
    if smollm2 is not None and (smollm2 / "tokenizer.json").is_file():
        found.append(load_tokenizer(str(smollm2)))
    return found


def test_split_text_rejoins_and_bounds_pieces():
    rng = random.Random(1)
    for text in _random_texts(2, 300):
        limit = rng.randint(2, 15)
        pieces = list(split_text(text, limit))
        assert "".join(pieces) == text and pieces
        # Every piece but the last ends at a cut point; one longer than the limit only when its
        # window held none.
        start = 0
        for piece in pieces[:-1]:
            end = start + len(piece)
            assert _CUT.match(text, end) is not None
            if len(piece) > limit:
                assert _CUT.search(text, start + 1, start + limit + 1) is None
            start = end
    assert list(split_text("", 4)) == [""]
    assert list(split_text("word " * 4, 6)) == ["word", " word", " word", " word "]


def test_cut_documents_give_the_whole_document_tokens(tiny_folder):
    for tokenizer in _tokenizers(tiny_folder):
        assert tokenizer.split_safe, tokenizer.name
        texts = _random_texts(3, 120)
        whole = _whole(texts, tokenizer)
        lengths = [len(tokenizer.encode(t)) + len(tokenizer.eos_token_ids[:1]) for t in texts]
        rng = random.Random(4)
        for _ in range(4):
            tokens, offsets = tokenize_documents(texts, tokenizer, piece_chars=rng.randint(2, 12),
                                                 batch_chars=rng.randint(1, 40))
            assert tokens.tolist() == whole, tokenizer.name
            assert np.diff(offsets).tolist() == lengths


def test_real_text_cut_into_small_pieces_is_unchanged(tiny_folder):
    source = (Path(__file__).resolve().parent.parent / "samctl" / "cli.py").read_text()
    one_line = " ".join(source.split())  # a long line: only spaces to cut at
    for tokenizer in _tokenizers(tiny_folder):
        for text in (source, one_line):
            tokens, _ = tokenize_documents([text], tokenizer, append_eos=False, piece_chars=64, batch_chars=256)
            assert tokens.tolist() == tokenizer.encode(text), tokenizer.name


class _Spy:
    """A tokenizer that records what it is given."""

    def __init__(self, inner, split_safe: bool) -> None:
        self.inner, self.split_safe = inner, split_safe
        self.name, self.fingerprint = inner.name, inner.fingerprint
        self.vocab_size, self.eos_token_ids = inner.vocab_size, inner.eos_token_ids
        self.calls: list[list[str]] = []

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text)

    def encode_batch(self, texts):
        self.calls.append(list(texts))
        return self.inner.encode_batch(texts)

    def decode(self, ids):
        return self.inner.decode(ids)


def test_batches_and_pieces_are_bounded_and_progress_adds_up():
    huge = "word " * 20_000  # one 100k-character line
    texts = ["small one", huge, "", "tail\nend"]
    spy = _Spy(ByteTokenizer(), split_safe=True)
    reported = []
    tokens, offsets = tokenize_documents(texts, spy, batch_chars=1000, piece_chars=300,
                                         on_batch=lambda docs, count: reported.append((docs, count)))
    assert tokens.tolist() == _whole(texts, ByteTokenizer())
    assert max(len(piece) for call in spy.calls for piece in call) <= 300
    assert max(sum(map(len, call)) for call in spy.calls) < 1000 + 300
    assert sum(d for d, _ in reported) == len(texts) and sum(c for _, c in reported) == len(tokens)
    assert offsets[-1] == len(tokens) and len(offsets) == len(texts) + 1


def test_a_tokenizer_that_is_not_split_safe_gets_whole_documents():
    huge = "word " * 2000
    spy = _Spy(ByteTokenizer(), split_safe=False)
    tokens, _ = tokenize_documents([huge], spy, batch_chars=100, piece_chars=50)
    assert [len(piece) for call in spy.calls for piece in call] == [len(huge)]
    assert len(tokens) == len(huge) + 1


@pytest.mark.parametrize("which", ["tiny", "default", "smollm2", "hub-gpt2"])
def test_fast_tokenizer_equals_transformers(which, tiny_folder, tmp_path):
    if which == "hub-gpt2":  # GPT2Tokenizer with add_prefix_space, as SmolLM2's Hub folder (issue 42, item 7)
        save_hub_style_tokenizer(tmp_path / "hub")
    folder = {"tiny": tiny_folder, "default": DEFAULT_MODEL_DIR, "smollm2": _smollm2_folder(),
              "hub-gpt2": tmp_path / "hub"}[which]
    if folder is None or not (Path(folder) / "tokenizer.json").is_file():
        pytest.skip(f"{folder} is absent")
    from transformers import AutoTokenizer

    fast = load_tokenizer(str(folder))
    assert isinstance(fast, FastTokenizer)
    hf = HFTokenizer(AutoTokenizer.from_pretrained(str(folder), local_files_only=True), str(folder))
    assert (fast.fingerprint, fast.vocab_size, fast.eos_token_ids) == (hf.fingerprint, hf.vocab_size, hf.eos_token_ids)
    assert fast.split_safe == hf.split_safe
    for text in _random_texts(5, 40) + [Path(__file__).read_text()]:
        ids = fast.encode(text)
        assert ids == hf.encode(text)
        assert fast.decode(ids) == hf.decode(ids)


@pytest.mark.parametrize("config", [{"add_prefix_space": True}, {"clean_up_tokenization_spaces": True}])
def test_configs_that_change_the_backend_load_through_transformers(config, tmp_path):
    """A config under which transformers may encode or decode otherwise than the file's pipeline is
    not read by `tokenizers` alone (clean-up rewrites decoded BPE text in transformers 4.x; 5.x
    ignores it for BPE), and a light load declines it."""
    save_hub_style_tokenizer(tmp_path, **config)
    pytest.importorskip("transformers")
    assert isinstance(load_tokenizer(str(tmp_path)), HFTokenizer)
    assert load_tokenizer(str(tmp_path), light=True) is None


def test_add_prefix_space_that_the_file_lacks_changes_the_ids(tmp_path):
    """Why the config's add_prefix_space is checked against the file's: transformers applies it."""
    save_hub_style_tokenizer(tmp_path, add_prefix_space=True)
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    assert load_tokenizer(str(tmp_path)).encode("x = 1") != Tokenizer.from_file(
        str(tmp_path / "tokenizer.json")).encode("x = 1", add_special_tokens=False).ids

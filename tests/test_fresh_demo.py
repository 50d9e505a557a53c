"""The quick start says what the embedded model is for and where a real one is (issue 24, item 8)."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from samctl.tokenizer import DEFAULT_MODEL_DIR

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not DEFAULT_MODEL_DIR.is_dir(), reason="embedded default model not installed")
def test_using_the_embedded_model_says_it_is_not_for_correct_edits(caplog):
    from samctl.models import load_engine

    with caplog.at_level(logging.INFO, logger="samctl"):
        load_engine(None, "cpu")
    err = caplog.text
    assert "tiny, to show speed and exactness, not correct answers or edits" in err
    assert "samctl fetch smollm2" in err and "model= models/SmolLM2-135M-Instruct.Q4_1.gguf" in err  # Python's wording


def test_the_quick_start_says_what_the_embedded_model_is():
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Quick start")
    quick = readme[start:readme.index("### A real model", start)]
    assert "The embedded default model is tiny" in quick and "not a correct edit" in quick
    assert "(#a-real-model-smollm2-135m-instruct)" in quick

"""tools/gen_references.py on a tiny model: rows name their tokenizer, and simulate holds them to it."""
from __future__ import annotations

import json
import subprocess
import sys

from tools.gen_references import main as gen_references


def samctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "samctl", *args], capture_output=True, text=True, timeout=300)


def test_references_record_the_tokenizer_and_simulate_refuses_another(model_dir, tmp_path):
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps(q) for q in [
        {"question_id": 1, "category": "code", "turns": ["def add(a, b):\n    return a + b\n"]},
        {"question_id": 2, "category": "qa", "turns": ["The quick brown fox", "The dog sleeps."]},
    ]) + "\n")
    refs = tmp_path / "refs.jsonl"
    gen_references(["--questions", str(questions), "--out", str(refs), "--model", str(model_dir),
                    "--max-new-tokens", "8", "--threads", "1", "--device", "cpu"])
    rows = [json.loads(line) for line in refs.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["1.0", "2.0", "2.1"]
    from transformers import AutoTokenizer

    from samctl.tokenizer import tokenizer_fingerprint

    fingerprint = tokenizer_fingerprint(AutoTokenizer.from_pretrained(model_dir))
    assert all(r["tokenizer"] == {"name": str(model_dir), "fingerprint": fingerprint} for r in rows)

    same = samctl("simulate", "--traces", str(refs), "--tokenizer", str(model_dir), "--methods", "ar,pld", "--json")
    assert same.returncode == 0, same.stderr
    assert json.loads(same.stdout)["methods"]["ar"]["overall"]["new_tokens"] == sum(len(r["output_ids"]) for r in rows)
    other = samctl("simulate", "--traces", str(refs), "--tokenizer", "bytes", "--methods", "pld")
    assert other.returncode == 2, other.stderr
    assert f"the ids come from tokenizer {model_dir} (fingerprint {fingerprint})" in other.stderr
    assert f"pass --tokenizer {model_dir}" in other.stderr

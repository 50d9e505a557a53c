"""Instruction sets the trainers read: (instruction, response) pairs per set.

Known files in a data folder: GSM8K's `gsm8k_train.jsonl` (question/answer), CodeAlpaca's
`codealpaca.json` and GPTeacher's `gpteacher_roleplay.json` (Alpaca instruction/input/output).
"""
from __future__ import annotations

import json
from pathlib import Path


def read_instruction_rows(data_dir: Path | None) -> dict[str, list[tuple[str, str]]]:
    """(instruction, response) pairs per instruction set; missing files give empty lists."""
    rows: dict[str, list[tuple[str, str]]] = {"gsm8k": [], "codealpaca": [], "roleplay": []}
    if data_dir is None:
        return rows
    gsm = data_dir / "gsm8k_train.jsonl"
    if gsm.exists():
        for line in gsm.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                rows["gsm8k"].append((row["question"], row["answer"]))
    for name, filename in (("codealpaca", "codealpaca.json"), ("roleplay", "gpteacher_roleplay.json")):
        path = data_dir / filename
        if path.exists():
            for row in json.loads(path.read_text(encoding="utf-8")):
                instruction = row["instruction"].strip()
                if row.get("input", "").strip():
                    instruction += "\n\n" + row["input"].strip()
                rows[name].append((instruction, row["output"].strip()))
    return rows

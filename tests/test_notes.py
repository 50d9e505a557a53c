"""The library never writes to the terminal: its notes go to the `samctl` logger, and the command
line prints them at its boundary, once each; `--quiet` keeps warnings and errors only. What a
session loads is planned first (samctl.plan), from what the method registry says it requires."""
from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest
import torch

from samctl.cli import main
from samctl.config import SessionConfig
from samctl.decode.methods import REGISTRY, REQUIREMENTS
from samctl.index.errors import ConfigError
from samctl.plan import DEFAULT_DRAFT_DIR, DEFAULT_EAGLE_DIR, plan

ROOT = Path(__file__).resolve().parent.parent
# The library below the command line: the session, what it loads, decoding and the datastores.
QUIET_MODULES = [ROOT / "samctl" / f"{name}.py" for name in ("session", "plan", "models", "stores")] + [
    path for folder in ("decode", "index") for path in sorted((ROOT / folder).rglob("*.py"))]


def terminal_writes(path: Path) -> list[str]:
    """`import click`, `print(...)` and `click.echo(...)` in a module, as path:line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        imported = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) else []
        func = node.func if isinstance(node, ast.Call) else None
        if any(name == "click" or str(name).startswith("click.") for name in imported) \
                or isinstance(func, ast.Name) and func.id == "print" \
                or isinstance(func, ast.Attribute) and func.attr == "echo" and getattr(func.value, "id", "") == "click":
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_the_library_never_writes_to_the_terminal():
    assert len(QUIET_MODULES) > 20
    found = [where for path in QUIET_MODULES for where in terminal_writes(path)]
    assert not found, found
    probe = ROOT / "samctl" / "options.py"  # the check finds what it looks for
    assert terminal_writes(probe)


def test_a_method_requires_what_its_entry_says():
    assert all(m.requires <= set(REQUIREMENTS) for m in REGISTRY.values())
    assert REGISTRY["specdec++"].requires == {"draft_model", "acc_head"}
    assert REGISTRY["sam+eagle"].needs_eagle and not REGISTRY["adaptive"].requires


def test_the_plan_resolves_paths_and_returns_notes_as_data(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="samctl"):
        chosen = plan(SessionConfig(method="pld", draft_model="d", eagle_head="e", store="s.sam"))
    assert not caplog.records  # notes are data here, logged by the session that acts on them
    assert chosen.draft_model is chosen.eagle_head is None and chosen.model.endswith("target")
    assert [str(n) for n in chosen.notes if "does not use" in str(n)] == [  # in Python; flags on the command line
        "note: method pld does not use draft_model=", "note: method pld does not use eagle_head=",
        "note: method pld does not use the store s.sam"]
    if DEFAULT_EAGLE_DIR.is_dir():
        assert plan(SessionConfig(method="eagle")).eagle_head == str(DEFAULT_EAGLE_DIR)
    if DEFAULT_DRAFT_DIR.is_dir():
        assert plan(SessionConfig(method="sd")).draft_model == str(DEFAULT_DRAFT_DIR)
    with pytest.raises(ConfigError) as err:  # refused before any model loads
        plan(SessionConfig(method="eagle", model=str(tmp_path)))
    assert err.value.fields == ("eagle_head",)


def _notes(capsys, *args: str) -> list[str]:
    main(["generate", "--prompt", "def f(x):", "--max-new-tokens", "4", "--threads", "1", *args])
    return [line for line in capsys.readouterr().err.splitlines() if not line.startswith("samctl: eagle:")]


@pytest.mark.skipif(not DEFAULT_EAGLE_DIR.is_dir(), reason="the embedded EAGLE head is not installed")
def test_the_command_line_prints_each_note_once_and_quiet_keeps_none(capsys):
    said = _notes(capsys, "--method", "eagle", "--compare", "--compare-runs", "2", "--max-nodes", "3")
    assert "samctl: using the embedded EAGLE head (default/eagle_head)" in said
    assert any(line.startswith("samctl: using the embedded default model") for line in said)
    assert len(said) == len(set(said)), said
    assert _notes(capsys, "--method", "eagle", "--quiet") == []


def test_python_users_get_notes_from_the_logger_only(capsys):
    from samctl.session import Session

    heard: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(record.getMessage())
    logger = logging.getLogger("samctl")
    before = logger.handlers, logger.level  # the command line's printer too, where a test ran it
    logger.handlers, logger.level = [handler], logging.INFO
    try:
        Session(SessionConfig(method="pld", max_new_tokens=2, draft_model="d"))
        Session(SessionConfig(method="pld", max_new_tokens=2, quiet=True))
    finally:
        logger.handlers, logger.level = before
    assert heard.count("note: method pld does not use draft_model=") == 1  # the argument, to Python
    assert sum(n.startswith("using the embedded default model") for n in heard) == 1
    assert capsys.readouterr().err == ""


def test_hf_takes_the_draft_model_its_errors_ask_for():
    import samctl.hf
    from transformers import AutoModelForCausalLM

    if not DEFAULT_DRAFT_DIR.is_dir():
        pytest.skip("the embedded draft model is not installed")
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_DRAFT_DIR.parent / "target", dtype=torch.float32).eval()
    with pytest.raises(ConfigError, match="pass draft_model="):
        model.generate(torch.tensor([[5, 6, 7]]), custom_generate=samctl.hf.make_generate(method="sd", store=None),
                       max_new_tokens=4, do_sample=False)
    custom = samctl.hf.make_generate(method="sd", draft_model=DEFAULT_DRAFT_DIR)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7]])
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)
    got = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                         custom_generate=custom)
    assert torch.equal(got, expected) and custom.last_metrics.drafted > 0


def test_a_session_over_a_loaded_model_takes_the_configs_graphs_setting(monkeypatch):
    # samctl.hf's sessions: on CUDA they capture graphs as a command's do (a no-op on a CPU)
    from samctl.models import load_engine
    from samctl.session import Session

    asked = []
    monkeypatch.setattr("samctl.session.enable_cuda_graphs", lambda target, enabled: asked.append(enabled))
    engine = load_engine(None, "cpu")
    Session.over(engine, SessionConfig(method="pld", max_new_tokens=2))
    Session.over(engine, SessionConfig(method="pld", max_new_tokens=2, graphs=False))
    engine.target.graphs = object()  # graphs already captured: kept
    Session.over(engine, SessionConfig(method="pld", max_new_tokens=2))
    assert asked == [True, False]

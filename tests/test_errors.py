"""Errors at one boundary: below the CLI a wrong setting names its configuration field; the
command line words it as a flag, the Python API as an argument."""
from __future__ import annotations

import ast
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import samctl
from samctl.decode.acceptance_head import TrainConfig
from samctl.decode.configs import RestConfig
from samctl.decode.drafters.rest import RestDrafter
from samctl.decode.engine.cpu_linear import apply_cpu_linear
from samctl.cli import main
from samctl.index.errors import ConfigError
from samctl.index.ngram import NgramTable


def cli_error(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as stop:
        main(["generate", "--prompt", "x", "--quiet", *args])
    assert stop.value.code == 2
    return capsys.readouterr().err.strip()


@pytest.mark.parametrize("args,settings,flag,argument", [
    (("--max-nodes", "-1"), {"settings": {"max_nodes": -1}}, "--max-nodes", "max_nodes="),
    (("--max-new-tokens", "0"), {"max_new_tokens": 0}, "--max-new-tokens", "max_new_tokens="),
    (("--gamma", "0"), {"settings": {"gamma": 0}}, "--gamma", "gamma="),
    (("--threads", "0"), {"threads": 0}, "--threads", "threads="),
])
def test_the_same_mistake_names_the_flag_or_the_argument(capsys, args, settings, flag, argument):
    said = cli_error(capsys, *args)
    assert said.startswith(f"samctl: error: {flag} ") and argument not in said
    with pytest.raises(ConfigError) as err:
        samctl.SessionConfig(**settings)
    assert str(err.value).startswith(f"{argument} ") and flag not in str(err.value)
    assert err.value.fields == (argument[:-1],)


def test_a_missing_head_names_the_flag_or_the_argument(capsys, tmp_path):
    said = cli_error(capsys, "--method", "eagle", "--model", str(tmp_path))
    assert "pass --eagle-head with a folder" in said
    with pytest.raises(ConfigError, match="pass eagle_head= with a folder") as err:
        samctl.Session(samctl.SessionConfig(method="eagle", model=str(tmp_path)))
    assert "--" not in str(err.value).split("`")[0]


def test_a_config_error_pickles_with_its_fields():
    err = ConfigError("{sat_count} {k} is more than {slots}", k=9, slots={"a": 1})
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) == "sat_count= 9 is more than {'a': 1}" and back.fields == ("sat_count",)


# A flag, and a command line to run (quoted in backticks, whole: `samctl build --kind sam`), which
# may name its own command's flags: how else to say which store to build.
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
COMMAND = re.compile(r"`samctl [^`]*`")


def error_texts(path: Path):
    """(line, text) of every string an exception raised or a note logged in `path` is built from: the
    arguments of a `...Error(...)`, `log.info/warning(...)` or `notes.append(...)` call, f-strings
    whole (their fields as {}), and the module constants it reads."""
    tree = ast.parse(path.read_text())
    constants = {node.targets[0].id: node.value.value for node in tree.body
                 if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}

    def text(node) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            return constants.get(node.id)
        if isinstance(node, ast.FormattedValue):
            return text(node.value) or "{}"
        if isinstance(node, ast.JoinedStr):
            return "".join(text(v) or "{}" for v in node.values)
        return None

    for node in ast.walk(tree):
        func = getattr(node, "func", None)
        said = isinstance(func, ast.Attribute) and (func.attr, getattr(func.value, "id", "")) in NOTE_CALLS
        if not (isinstance(node, ast.Call) and (getattr(func, "id", getattr(func, "attr", "")).endswith("Error") or said)):
            continue
        inner = {id(v) for part in ast.walk(node) if isinstance(part, ast.JoinedStr) for v in ast.walk(part)
                 if v is not part}
        for part in ast.walk(node):
            if id(part) not in inner and (said := text(part)):
                yield node.lineno, said


# The session layer of samctl/: what the Python API runs through, below the command line.
SESSION_LAYER = ("session", "config", "plan", "models", "stores", "heads", "costs", "hf", "tokenizer")
NOTE_CALLS = {("info", "log"), ("warning", "log"), ("append", "notes")}


def test_errors_below_the_command_line_name_no_flags():
    # decode/, index/ and the session layer serve the Python API too: a setting is a ConfigError
    # field ("{quantize}"), worded as --quantize or quantize= at the boundary; only a quoted command
    # line names flags
    root = Path(__file__).resolve().parent.parent
    paths = [p for folder in ("decode", "index") for p in sorted((root / folder).rglob("*.py"))]
    named = [f"{path.relative_to(root)}:{line}: {FLAG.findall(COMMAND.sub('', text))}"
             for path in paths + [root / "samctl" / f"{name}.py" for name in SESSION_LAYER]
             for line, text in error_texts(path) if FLAG.search(COMMAND.sub("", text))]
    assert not named, "\n".join(named)
    assert FLAG.search(COMMAND.sub("", "run without --quantize")) and not FLAG.search(COMMAND.sub("", "`samctl build --kind sam`"))


@pytest.mark.parametrize("make,flags,arguments", [
    (lambda: apply_cpu_linear(torch.nn.Linear(2, 2), "int4"), ["--quantize"], ["quantize="]),
    (lambda: apply_cpu_linear(torch.nn.Linear(2, 2).to("meta"), "int8"), ["--quantize", "--device"],
     ["quantize=", "device="]),
    (lambda: TrainConfig(mixing_ratio=1.5), ["--mixing-ratio"], ["mixing_ratio="]),
    (lambda: RestDrafter(RestConfig(), NgramTable.build(np.arange(3, 40, dtype=np.int32), np.array([0, 37]))),
     ["--sam"], ["store="]),
])
def test_library_settings_errors_name_the_flag_or_the_argument(make, flags, arguments):
    from samctl.options import cli_message

    with pytest.raises(ConfigError) as err:
        make()
    said, api = cli_message(err.value), str(err.value)
    assert all(f in said for f in flags) and not any(a in said for a in arguments), said
    assert all(a in api for a in arguments) and not FLAG.search(COMMAND.sub("", api)), api



def test_a_note_names_the_argument_in_the_library_and_the_flag_on_the_command_line(capsys):
    import logging

    from samctl.cli import _NOTES
    from samctl.index.errors import Note

    note = Note("at most {room} new tokens fit, fewer than {max_new_tokens} {asked}", room=3, asked=9)
    assert str(note) == "at most 3 new tokens fit, fewer than max_new_tokens= 9"
    _NOTES.emit(logging.LogRecord("samctl", logging.INFO, __file__, 1, note, None, None))
    assert capsys.readouterr().err == "samctl: at most 3 new tokens fit, fewer than --max-new-tokens 9\n"

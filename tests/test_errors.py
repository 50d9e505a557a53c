"""Errors at one boundary: below the CLI a wrong setting names its configuration field; the
command line words it as a flag, the Python API as an argument."""
from __future__ import annotations

import pickle

import pytest

import samctl
from samctl.cli import main
from samctl.index.errors import ConfigError


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

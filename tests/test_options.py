"""Every command-line option that maps to a configuration field is made from that field, once:
each command's --help and click parameters against the dataclasses (samctl/options.py)."""
from __future__ import annotations

import dataclasses
import re

import click
import pytest

from samctl.commands import COMMANDS, load_command
from samctl.config import SessionConfig
from samctl.decode.methods import cli_fields, setting_default
from samctl.options import FieldOption, cli, config_fields, flag, session_config

FIELDS = {key: (f, owner) for key, f, owner in config_fields()}
FLAGS = {name: key for key, (f, _) in FIELDS.items() for name in re.findall(r"-{1,2}[\w-]+", cli(f))}
# A command's own defaults, each on purpose (any other field option takes the field's default).
COMMAND_DEFAULTS = {
    ("bench", "max_new_tokens"): 128, ("chat", "max_new_tokens"): 512, ("serve", "max_new_tokens"): 1024,
    ("simulate", "max_new_tokens"): None,  # whole references
    ("distill", "chat"): None,  # the model's chat template decides
    ("serve", "store"): (),  # --sam NAME=STORE, repeatable
}
# Options of other things that share a flag with a field: the n-gram store's next tokens per context.
NOT_FIELDS = {("build", "--top-k"), ("query", "--top-k")}


def _field_default(key: str) -> object:
    f, owner = FIELDS[key]
    if "cpu_default" in f.metadata:
        return None  # unset: the device decides
    if f.metadata.get("negate"):
        return False
    return setting_default(owner, f) if owner not in ("session", "sampling") else f.default


@pytest.mark.parametrize("name", [name for name, _ in COMMANDS])
def test_field_options_come_from_their_fields_with_their_defaults(name):
    command = load_command(name)
    text = command.get_help(click.Context(command, info_name=name))
    seen = set()
    for param in command.params:
        if not isinstance(param, FieldOption):
            shared = [f for f in param.opts + param.secondary_opts if f in FLAGS and (name, f) not in NOT_FIELDS]
            assert not shared, f"{name} declares {shared} by hand: take it from its field (samctl/options.py)"
            continue
        key = param.name
        f, owner = FIELDS[key]
        assert param.field == f"{owner}.{f.name}" and key not in seen
        seen.add(key)
        assert param.default == COMMAND_DEFAULTS.get((name, key), _field_default(key)), (name, key, param.default)
        for option in param.opts + param.secondary_opts:
            assert option in text, (name, option)


def test_every_session_field_has_an_option_and_every_option_builds_the_config():
    without = {f.name for f in dataclasses.fields(SessionConfig) if "help" not in f.metadata}
    assert without == {"settings", "sampling", "occurrence"}  # options of their own fields, or a setting's
    assert {owner for _, (_, owner) in FIELDS.items()} >= {"session", "sampling", "sam", "draft", "specdec"}
    assert len(FIELDS) == len(config_fields())  # no key twice
    command = load_command("generate")
    ctx = command.make_context("generate", ["--prompt", "x", "--sam", "s.sam", "--no-compile", "--bounds", "1", "6",
                                            "--temperature", "0.5", "--max-nodes", "9", "--la-ngram", "3"])
    values = {key: value for key, value in ctx.params.items() if key in FIELDS}
    config = session_config(values)
    assert (config.store, config.graphs, config.sampling.temperature) == ("s.sam", False, 0.5)
    assert config.settings["bounds"] == (1, 6) and config.settings["max_nodes"] == 9
    method = config.method_config(__import__("torch").device("cpu"))
    assert (method.specdec.min_draft, method.specdec.max_draft, method.lookahead.ngram) == (1, 6, 3)
    assert method.recycle.nodes == 16 and config.method_config(__import__("torch").device("cuda")).recycle.nodes == 80


def test_errors_name_fields_by_their_flags():
    assert [flag(k) for k in ("store", "graphs", "quiet", "bounds", "top_k", "eagle_top_k", "mixing_ratio")] == \
        ["--sam", "--no-compile", "--quiet", "--bounds", "--top-k", "--eagle-top-k", "--mixing-ratio"]
    assert {section for section, _ in cli_fields()} >= {"draft", "specdec"}


@pytest.mark.parametrize("module,config", [("eagle", "EagleTrainConfig"), ("sdsat", "SdsatTrainConfig"),
                                           ("acc_head", "AccHeadTrainConfig")])
def test_trainers_take_frozen_settings_as_options_and_leave_the_environment_alone(module, config, monkeypatch, capsys):
    import importlib
    import os

    trainer = importlib.import_module(f"samctl.train.{module}")  # torch and the rest, which set their own
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    before = dict(os.environ)
    trainer = importlib.reload(trainer)
    assert dict(os.environ) == before  # nothing set at import
    settings = getattr(trainer, config)
    assert settings.__dataclass_params__.frozen
    assert trainer.main(["--help"]) == 0
    text = capsys.readouterr().out
    assert all("--" + f.name.replace("_", "-") in text for f in dataclasses.fields(settings))


def test_simulate_offers_the_settings_of_the_methods_it_replays():
    # from the registry: a drafter setting is an option exactly when a replayable method reads it
    from samctl.decode.methods import REPLAYABLE, method, setting_name

    command = load_command("simulate")
    keys = {p.name for p in command.params if isinstance(p, FieldOption)}
    for section, f in cli_fields():
        read = any(method(m).reads(f"{section}.{f.name}") for m in REPLAYABLE)
        assert (setting_name(f) in keys) == read, (section, f.name)
    assert {"pld_ngram", "la_window", "rest_nodes"} <= keys and not keys & {"gamma", "sat_count", "eagle_top_k"}


@pytest.mark.parametrize("name", [name for name, _ in COMMANDS if name != "train"])
def test_option_help_names_only_the_commands_own_options(name):
    # a flag an option's help names is one of this command's, unless it names another command's
    # (`simulate --cost-curve`); distill's --batch-size once listed generate's --compare and --ray
    command = load_command(name)
    own = {o for p in command.params for o in p.opts + p.secondary_opts}
    others = {n for n, _ in COMMANDS}
    for param in command.params:
        for before, flag_name in re.findall(r"(\w*)\W{0,2}(?<![\w-])(--[a-z][\w-]*)", getattr(param, "help", "") or ""):
            assert flag_name in own or before in others, (name, param.name, flag_name)

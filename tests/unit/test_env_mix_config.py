"""[[env]] tables in our TOML, and verifiers' Hosted Training configs (`configs/rl/*.toml`) run as written: what has
a local meaning lands in our settings, the rest is named once, and the upstream files plan."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from verifiers_rl.config.hosted import NOTED
from verifiers_rl.config.run_file import RunFile
from verifiers_rl.errors import ConfigError
from verifiers_rl.plan.run import probe_machine
from verifiers_rl.scripts.rl_plan import build_plan, render

HOSTED = Path(__file__).resolve().parents[1] / "data" / "upstream" / "hosted"
TWO = 'model = "m"\n[[env]]\nid = "reverse-text"\nratio = 2\n[[env]]\nid = "alphabet-sort"\n[env.args]\nseed = 1\n'


def _validate(text: str, *overrides: str, command: str = "vf-rl"):
    return RunFile.parse(tomllib.loads(text), list(overrides), command)


@pytest.fixture(autouse=True)
def _fresh_note(monkeypatch):
    monkeypatch.delenv(NOTED, raising=False)


def test_env_tables_are_kept_with_args_and_ratios():
    cfg = _validate(TWO)
    assert cfg.env_spec() == [{"id": "reverse-text", "ratio": 2}, {"id": "alphabet-sort", "args": {"seed": 1}}]
    one = _validate('model = "m"\n[[env]]\nid = "reverse-text"\n')
    assert one.env_spec() == {"id": "reverse-text"}  # one table is one environment, as [env] is
    assert _validate('model = "m"\n[env]\nid = "reverse-text"\n').env_spec() == {"id": "reverse-text"}


@pytest.mark.parametrize(
    "text, message",
    [
        (TWO.replace("ratio = 2", "ratoi = 2"), "unknown key 'env[0].ratoi' (did you mean 'ratio'?)"),
        (TWO.replace("[env.args]\nseed = 1\n", "ratio = -1\n"), "env[1].ratio=-1: a sampling ratio is a number >= 0"),
        (
            TWO.replace("ratio = 2", "ratio = 0").replace("[env.args]\nseed = 1", "ratio = 0"),
            "env[0].ratio=0, env[1].ratio=0: the ratios sum to 0",
        ),
        (TWO.replace('id = "alphabet-sort"', "ratio = 1"), "env[1]: missing required key id"),
        (TWO.replace("ratio = 2", 'ratio = "2"'), "env[0].ratio='2': expected int or float"),
    ],
)
def test_bad_env_tables_are_one_line_naming_the_entry(text, message):
    with pytest.raises(ConfigError) as e:
        _validate(text)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_vf_sft_takes_one_env():
    with pytest.raises(ConfigError, match=r"vf-sft takes one \[env\]"):
        _validate(TWO, command="vf-sft")


def test_hosted_config_maps_onto_our_settings(capsys):
    cfg = _validate((HOSTED / "qwen-3-5-moe-advanced.toml").read_text())
    args = cfg.trainer.args
    assert {k: args[k] for k in ("max_steps", "batch_size", "rollouts_per_example", "max_async_level")} == {
        "max_steps": 500, "batch_size": 512, "rollouts_per_example": 16, "max_async_level": 4}  # fmt: skip
    assert args["oversampling_factor"] == 2.0 and args["online_difficulty_filtering"] is True and args["seed"] == 42
    assert args["max_tokens"] == 4096 and args["temperature"] == 0.7 and args["max_seq_len"] == 4096 + 2048
    assert args["eval_strategy"] == "steps" and args["eval_steps"] == 25
    assert cfg.eval.model_dump(exclude_defaults=True) == {"num_examples": 64, "rollouts_per_example": 1, "before": True}
    assert cfg.env_spec() == [
        {"id": "primeintellect/wiki-search", "ratio": 0.5},
        {"id": "primeintellect/wordle", "ratio": 0.5},
    ]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "mean nothing to a local run" in err[0]
    for key in ("buffer.easy_threshold", "buffer.hard_fraction", "[val]", "[[eval.env]]"):
        assert key in err[0]
    _validate((HOSTED / "qwen-3-5-moe-advanced.toml").read_text())
    assert capsys.readouterr().err == ""  # named once per command (its trainer processes inherit the mark)


def test_hosted_wandb_and_unknown_keys():
    text = 'model = "m"\nmax_steps = 3\nfancy = 1\n[wandb]\nproject = "p"\nname = "n"\nsecret_sauce = 1\n'
    text += '[sampling]\nmax_tokens = 16\nlogprobs = true\n[[env]]\nid = "reverse-text"\nharness = {}\n'
    cfg = _validate(text)
    assert cfg.trainer.args["wandb"] == {"project": "p", "name": "n"} and cfg.trainer.args["max_steps"] == 3
    assert cfg.env_spec() == {"id": "reverse-text"}


def test_hosted_keys_meet_our_own_spelling(capsys):
    text = (HOSTED / "qwen-3-5.toml").read_text()
    cfg = _validate(text, "--trainer.args.max_steps", "2")  # the command line wins over the file's max_steps
    assert cfg.trainer.args["max_steps"] == 2
    with pytest.raises(ConfigError, match=r"max_steps=100 and trainer.args.max_steps=5 are one setting"):
        _validate(text + "\n[trainer.args]\nmax_steps = 5\n")
    with pytest.raises(ConfigError, match=r"buffer.env_ratios=\[1, 2\]: one ratio per \[\[env\]\] table \(1\)"):
        _validate(text + "\n[buffer]\nenv_ratios = [1, 2]\n")


@pytest.mark.parametrize("name", sorted(p.stem for p in HOSTED.glob("*.toml")))
@pytest.mark.parametrize("gpus", [0, 8])
def test_hosted_configs_plan(name, gpus):
    """`vf-rl @ <hosted config> --dry-run` plans as written (no GPU here; 8 as `--gpus 8` plans them)."""
    path = HOSTED / f"{name}.toml"
    plan = build_plan(RunFile.read(path), probe_machine(gpus, 80), dry_run=True)
    text = render(plan)
    assert plan.server.command() and "# environment" in text
    ids = [e.id for e in plan.run_file.env]
    assert all(i in text for i in ids)


def test_a_toml_date_is_refused_naming_its_key():
    """The resolved config travels as JSON to the trainer processes (the run plan): a TOML date, which JSON cannot
    carry, stops at validation with its key, not with a TypeError once the server has started."""
    text = 'model = "tiny"\n[env]\nid = "reverse-text"\n[env.args]\nsince = 2024-05-01\n'
    text += "[[env.args.windows]]\nat = 07:30:00\n"
    cfg = tomllib.loads(text)
    with pytest.raises(ConfigError, match=r"^env\.args\.since = 2024-05-01: TOML dates and times are not supported"):
        RunFile.parse(cfg)
    cfg["env"]["args"]["since"] = "2024-05-01"
    with pytest.raises(ConfigError, match=r"^env\.args\.windows\[0\]\.at = 07:30:00: .* as a string, \"07:30:00\""):
        RunFile.parse(cfg)
    cfg["env"]["args"]["windows"] = [{"at": "07:30:00"}]
    RunFile.parse(cfg)

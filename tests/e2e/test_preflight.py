"""Errors that used to come after the server started, checked before anything starts (issue 55): wandb without a
login, an environment that is not installed, every prompt longer than the prompt limit. `vf-rl --dry-run` fails on
each with the same line as the run, and the run starts nothing."""

from __future__ import annotations

import pytest
from procs import run_command, survivors
from runs import write_cfg

NO_WANDB_LOGIN = {"WANDB_API_KEY": "", "WANDB_MODE": "online", "WANDB_DISABLED": ""}


def _error_line(r, prog="vf-rl") -> str:
    lines = [x for x in r.stderr.splitlines() if x.startswith(f"{prog}: error:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    return lines[0]


def _dry_run_and_run_stop_alike(cfg, code: int, env: dict | None = None) -> str:
    dry, _ = run_command("vf-rl", "@", cfg, "--dry-run", env=env)
    r, pid = run_command("vf-rl", "@", cfg, env=env, timeout=300)
    assert dry.returncode == r.returncode == code, (dry.returncode, r.returncode, r.stderr[-3000:])
    line = _error_line(r)
    assert line == _error_line(dry)
    assert "inference server" not in r.stdout and not survivors(pid)  # nothing started
    return line


@pytest.fixture
def no_login(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    return {**NO_WANDB_LOGIN, "HOME": str(home), "NETRC": str(home / ".netrc"), "WANDB_CONFIG_DIR": str(home / "wb")}


def test_wandb_without_a_login_stops_before_anything_starts(tiny_model_dir, tmp_path, no_login):
    cfg = write_cfg(tmp_path, tiny_model_dir, extra='report_to = "wandb"\n')
    line = _dry_run_and_run_stop_alike(cfg, 2, env=no_login)
    assert "report_to includes wandb, but wandb has no login on this machine (no WANDB_API_KEY, no api.wandb.ai" in line
    assert 'run `wandb login`, or set [trainer.args.wandb] mode = "offline"' in line
    # a login (what `wandb login` writes) or offline mode is enough to pass the check
    (tmp_path / "home" / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    r, _ = run_command("vf-rl", "@", cfg, "--dry-run", env=no_login)
    assert r.returncode == 0, r.stderr[-2000:]


def test_wandb_reads_its_login_from_its_settings_files(tmp_path, no_login, monkeypatch):
    """wandb also takes an api_key from its settings files (system: $WANDB_CONFIG_DIR/settings; workspace:
    ./wandb/settings), and its base_url says which ~/.netrc host counts."""
    from types import SimpleNamespace

    from verifiers_rl.config.reporting import wandb_login_problem

    for key, value in no_login.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    args = SimpleNamespace(report_to=["wandb"], wandb={})
    assert "no api.wandb.ai entry" in wandb_login_problem(args)
    system = tmp_path / "home" / "wb" / "settings"
    system.parent.mkdir()
    system.write_text("[default]\nbase_url = https://wandb.example.org\n")
    assert "no wandb.example.org entry" in wandb_login_problem(args)
    (tmp_path / "home" / ".netrc").write_text("machine wandb.example.org\n  login user\n  password abc\n")
    assert wandb_login_problem(args) is None
    (tmp_path / "home" / ".netrc").unlink()
    (tmp_path / "wandb").mkdir()
    (tmp_path / "wandb" / "settings").write_text("[default]\napi_key = local-key\n")
    assert wandb_login_problem(args) is None


def test_wandb_without_a_login_in_python(tiny_model_dir, tmp_path, no_login, monkeypatch):
    from rl_envs import reverse_env
    from runs import tiny_rl_config

    from verifiers_rl.errors import TrainingError
    from verifiers_rl.trainer import RLTrainer

    for key, value in no_login.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(TrainingError, match="report_to includes wandb, but wandb has no login"):
        RLTrainer(model=tiny_model_dir, env=reverse_env(), args=tiny_rl_config(tmp_path, report_to="wandb"))


def test_an_environment_that_is_not_installed_stops_the_dry_run(tiny_model_dir, tmp_path):
    cfg = write_cfg(tmp_path, tiny_model_dir, replace={'id = "reverse-text"': 'id = "no-such-env"'})
    line = _dry_run_and_run_stop_alike(cfg, 2)
    assert "environment 'no-such-env' is not installed: install it with" in line


def test_every_prompt_too_long_stops_the_dry_run(tiny_model_dir, tmp_path):
    cfg = write_cfg(tmp_path, tiny_model_dir, replace={"max_seq_len = 512": "max_seq_len = 24"})
    line = _dry_run_and_run_stop_alike(cfg, 1)
    assert "every one of the 32 prompts is longer than the prompt limit of 16 tokens" in line

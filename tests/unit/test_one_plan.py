"""One configuration, one plan: every spelling of a setting lands in one field, and what `vf-rl --dry-run` prints
is what `vf-rl` launches, byte for byte (a free port aside), for the layouts users run.

No GPU here: plans for 1, 2 and 8 GPUs are made as `vf-rl --dry-run --gpus N` makes them, then launched through
`vf-rl`'s own `run()` with process creation recorded (the device is what is faked: nothing is started on one).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from verifiers_rl.config.net import free_port
from verifiers_rl.config.run_file import RunFile, build_rl_config
from verifiers_rl.errors import ConfigError
from verifiers_rl.plan.run import PLAN_ENV, probe_machine
from verifiers_rl.scripts.rl_plan import build_plan, rank_inputs, render

ROOT = Path(__file__).resolve().parents[2]
UPSTREAM = ROOT / "tests" / "data" / "upstream"
ZERO3 = ROOT / "configs" / "accelerate" / "zero3.yaml"


def _config(tmp_path, model: str, *, inference: int, trainer: int, args: dict, tables: str = "") -> Path:
    lines = [f'model = "{model}"', f'output_dir = "{tmp_path / "out"}"', "[env]", 'id = "reverse-text"']
    lines += ["[inference]", f"gpus = {inference}", "[trainer]", f"gpus = {trainer}", tables, "[trainer.args]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in args.items()]
    path = tmp_path / "cfg.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _plan(path: Path, gpus: int, overrides=()):
    return build_plan(RunFile.read(path, list(overrides)), probe_machine(gpus, 80), dry_run=True)


def _printed(text: str, section: str) -> str:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"# {section}"))
    return lines[start + 1]


def _launch(plan, monkeypatch) -> dict:
    """vf-rl's `run(plan)` with process creation recorded: the server's and the trainer's command lines and
    environments as vf-rl hands them to the OS (a harmless process stands in for each)."""
    from verifiers_rl.scripts import rl
    from verifiers_rl.serving.launcher import InferenceServer

    seen: dict = {}
    real_popen = subprocess.Popen

    def popen(cmd, **kw):
        role = "server" if "verifiers_rl.inference.server" in cmd else "trainer"
        seen[role] = (list(cmd), dict(kw.get("env") or {}))
        stand_in = ["sleep", "30"] if role == "server" else ["true"]
        return real_popen(stand_in, start_new_session=True)

    def in_process(model, env, args, cfg, server, serving, base):  # the CPU layout: the trainer in vf-rl
        seen["trainer_args"] = args
        return 0

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setattr(InferenceServer, "_wait_healthy", lambda self: None)
    monkeypatch.setattr(rl, "train_and_evaluate", in_process)
    monkeypatch.setattr(rl, "load_env", lambda cfg: None)
    assert rl.run(plan) == 0
    seen["port"] = plan.server.port
    return seen


LAYOUTS = {
    # name: (GPUs, [inference] gpus, [trainer] gpus, [trainer.args], extra tables)
    "cpu": (0, 1, 1, {}, ""),
    "1 gpu shared, lora": (1, 1, 1, {}, ""),
    "1 gpu shared, full": (1, 1, 1, {"use_lora": False}, ""),
    "2 gpus, lora": (2, 1, 1, {}, ""),
    "2 gpus, full": (2, 1, 1, {"use_lora": False}, ""),
    "8 gpus, dp 6 x 2 trainers": (8, 6, 2, {}, ""),
    "8 gpus, tp 2 x dp 2, 2 trainers": (8, 4, 2, {}, "[inference.args]\ntensor_parallel_size = 2"),
    "8 gpus, zero3 x 4, full": (8, 4, 4, {"use_lora": False}, f'accelerate_config = "{ZERO3}"'),
    "1 gpu, the user's vLLM share": (1, 1, 1, {"server_args": ["--gpu-memory-utilization", "0.6"]}, ""),
    "2 gpus, full, changes only": (2, 1, 1, {"use_lora": False, "sync_changed_only": True}, ""),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_printed_plan_is_the_launched_plan(name, tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv(PLAN_ENV, raising=False)
    gpus, inference, trainer, args, tables = LAYOUTS[name]
    args = {"batch_size": 16, "rollouts_per_example": 4, "micro_batch_size": 2, "max_seq_len": 256, **args}
    plan = _plan(_config(tmp_path, tiny_model_dir, inference=inference, trainer=trainer, args=args, tables=tables),
                 gpus)  # fmt: skip
    text = render(plan)
    launched = _launch(plan, monkeypatch)

    argv, env = launched["server"]
    port = str(launched["port"])
    dev = f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} " if "CUDA_VISIBLE_DEVICES" in env else ""
    assert _printed(text, "inference server") == (dev + shlex.join(argv)).replace(
        f"--port {port}", "--port '<free port>'"
    )
    if gpus:
        cmd, trainer_env = launched["trainer"]
        printed = _printed(text, "trainer (")
        launched_line = f"CUDA_VISIBLE_DEVICES={trainer_env['CUDA_VISIBLE_DEVICES']} {shlex.join(cmd)}"
        assert printed == launched_line
        # the ranks get the plan and their resolved inputs once, in their environment: no config file to read again
        # and no settings on the command line; they train with the plan's config, the server's address aside
        assert cmd[-3:] == ["-m", "verifiers_rl.scripts.train", "--from-plan"]
        handed = json.loads(trainer_env[PLAN_ENV])
        assert handed["serving"]["sync_backend"] == plan.serving.sync_backend
        assert handed["trainer"]["config"] == plan.run_file.as_dict() and handed["trainer"]["model"] == plan.model
        rank = build_rl_config(handed["trainer"]["args"], cuda=False)
        assert rank.vllm_server_port == launched["port"] and rank.server_mode == "connect"
        started = {"vllm_server_port", "server_mode", "server_control_token"}
        assert _fields(rank, drop=started) == _fields(plan.args, drop=started)
    else:
        trained, planned = launched["trainer_args"], plan.args
        assert trained.vllm_server_port == launched["port"] and trained.server_mode == "connect"
        # the trainer trains with the plan's config, the server's address aside; the plan's stays as printed
        started = {"vllm_server_port", "server_mode", "server_control_token"}
        assert _fields(trained, drop=started) == _fields(planned, drop=started)
        assert planned.server_mode != "connect" and planned.vllm_server_port != launched["port"]
    if args.get("sync_changed_only"):  # vLLM's sparse NCCL engine on the server, the trainer's copy in the plan
        assert argv[argv.index("--weight-transfer-backend") + 1] == "sparse_nccl"
        assert "sync snapshot" in text
    if plan.serving.shared_gpu:  # the memory split printed is the share vLLM gets
        share = float(argv[argv.index("--gpu-memory-utilization") + 1])
        split = next(line for line in text.splitlines() if "on the same GPU" in line)
        assert f"vLLM --gpu-memory-utilization {share:.2f} on the same GPU" in split


def test_the_tutorials_port_is_the_servers_port_and_the_trainers(tmp_path, tiny_model_dir, monkeypatch):
    """The RLTrainer tutorial's fix for a busy port: `[trainer.args] vllm_server_port = 8001`."""
    port = free_port()
    path = _config(tmp_path, tiny_model_dir, inference=1, trainer=1, args={"batch_size": 8,
                   "rollouts_per_example": 4, "vllm_server_port": port})  # fmt: skip
    plan = _plan(path, 0)
    assert f"--port {port}" in _printed(render(plan), "inference server")
    launched = _launch(plan, monkeypatch)
    assert launched["port"] == port and launched["trainer_args"].vllm_server_port == port


def test_one_setting_spelled_twice():
    base = {"model": "m", "env": {"id": "reverse-text"}}
    parse = RunFile.parse
    args = parse({**base, "inference": {"port": 8001, "host": "0.0.0.0", "startup_timeout": 900}}).trainer.args
    assert (args["vllm_server_port"], args["vllm_server_host"], args["vllm_server_timeout"]) == (8001, "0.0.0.0", 900)
    with pytest.raises(ConfigError, match=r"inference.port=8000 and trainer.args.vllm_server_port=8001 are one"):
        parse({**base, "inference": {"port": 8000}, "trainer": {"args": {"vllm_server_port": 8001}}})
    same = parse({**base, "inference": {"port": 8001}, "trainer": {"args": {"vllm_server_port": 8001}}})
    assert same.trainer.args["vllm_server_port"] == 8001
    # the command line wins over the file's other spelling
    file = {**base, "trainer": {"args": {"vllm_server_port": 8001}}}
    assert parse(file, ["--inference.port", "9000"]).trainer.args["vllm_server_port"] == 9000
    flags = parse({**base, "inference": {"args": {"enforce_eager": True, "max_num_seqs": 8}}})
    assert flags.trainer.args["server_args"] == ["--enforce-eager", "--max-num-seqs", "8"]
    with pytest.raises(ConfigError, match=r"inference.port='x': expected int"):
        parse({**base, "inference": {"port": "x"}})
    with pytest.raises(ConfigError, match=r"inference.engine='tpu': allowed"):
        parse({**base, "inference": {"engine": "tpu"}})


def test_the_tutorials_wandb_table(monkeypatch, tmp_path):
    """`[trainer.args.wandb]` (project, name, ...) reaches wandb.init; a key wandb users would not write is named."""
    from types import SimpleNamespace

    import wandb

    from verifiers_rl.trainer import RLConfig, RLTrainer

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    table = {"project": "reverse-text-tutorial", "name": "my-first-run", "tags": ["a"], "group": "g"}
    args = RLConfig(output_dir=str(tmp_path / "o"), use_cpu=True, wandb=table)
    assert args.report_to == ["wandb"]  # the table alone turns wandb on
    RLTrainer._start_wandb(SimpleNamespace(args=args, is_world_process_zero=lambda: True))
    try:
        run = wandb.run
        assert (run.project, run.name, tuple(run.tags), run.group) == ("reverse-text-tutorial", "my-first-run", ("a",),
                                                                       "g")  # fmt: skip
    finally:
        wandb.finish()
        wandb.teardown()  # wandb's process-wide settings (its dir) would otherwise outlive this test
    with pytest.raises(ValueError, match="wandb=.*unknown key.*projcet"):
        RLConfig(output_dir=str(tmp_path / "o"), use_cpu=True, wandb={"projcet": "x"})


@pytest.mark.parametrize("name", sorted(p.stem for p in UPSTREAM.glob("*.toml")))
def test_upstreams_configs_plan(name):
    """verifiers 0.1.14's own vf-rl configs plan on the GPUs they name (and a 1+1 config on one GPU, shared)."""
    path = UPSTREAM / f"{name}.toml"
    raw = tomllib.loads(path.read_text())
    gpus = raw["inference"]["gpus"] + raw["trainer"]["gpus"]
    for n in sorted({gpus, 1 if gpus == 2 else gpus}):
        plan = _plan(path, n)
        assert plan.server.command() and (plan.trainer_cmd or not n)
        if name == "math-python":  # 8 x 4096 tokens a micro-batch: checkpointing makes it fit, it is not refused
            assert plan.run.measures == {"activation_checkpointing": True}
            assert "chose activation_checkpointing" in render(plan)
            assert plan.args.activation_checkpointing is True  # the config the run trains with carries it
            _ranks_train_with(plan, path)


def _fields(args, drop=frozenset()) -> dict:
    return {k: v for k, v in dataclasses.asdict(args).items() if k not in drop}


def _ranks_train_with(plan, path: Path) -> None:
    """A trainer process vf-rl starts builds its RLConfig from the arguments the plan hands it (`rank_inputs`) and
    ends with the config the plan printed and vf-rl's own process holds (the server's address aside)."""
    import os
    from unittest import mock

    from verifiers_rl.plan.run import from_ranks_env

    with mock.patch.dict(os.environ, {PLAN_ENV: plan.run.for_ranks(rank_inputs(plan))}):
        rank = build_rl_config(from_ranks_env()[1]["args"], cuda=False)
    assert _fields(rank, drop={"server_mode"}) == _fields(plan.args, drop={"server_mode"})


def test_help_starts_nothing(tmp_path):
    cfg = tmp_path / "cfg.toml"
    cfg.write_text('model = "tiny"\n[env]\nid = "reverse-text"\n')
    bin_dir = Path(sys.executable).parent
    top = subprocess.run([bin_dir / "vf-rl", "--help"], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert top.returncode == 0
    for word in ("setup", "export", "--dry-run", "--gpus", "--gpu-memory", "--nodes"):
        assert word in top.stdout, word
    for cmd, args in (("vf-rl", ["@", cfg, "--help"]), ("vf-rl", ["@", cfg, "--dry-run", "-h"]),
                      ("vf-train", ["@", cfg, "-h"]), ("vf-sft", ["--help"])):  # fmt: skip
        r = subprocess.run([bin_dir / cmd, *map(str, args)], capture_output=True, text=True, cwd=tmp_path, timeout=60)
        assert r.returncode == 0 and r.stdout.startswith(f"usage: {cmd}"), (cmd, r.stderr)
    assert not (tmp_path / "outputs").exists()  # no tiny model built, no dataset loaded


def test_an_interrupted_tiny_model_build_leaves_nothing(tmp_path, monkeypatch):
    import verifiers_rl.tiny as tiny
    from verifiers_rl.scripts.common import resolve_model

    monkeypatch.chdir(tmp_path)
    real = tiny.save_tiny_model

    def interrupted(path, **kw):
        (Path(path) / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny, "save_tiny_model", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(RunFile.parse({"model": "tiny"}, command="vf-sft"))
    assert not any((tmp_path / "outputs" / "tiny-models").iterdir())
    monkeypatch.setattr(tiny, "save_tiny_model", real)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(
        resolve_model(RunFile.parse({"model": "tiny"}, command="vf-sft"))
    )  # built whole the next time


def test_dry_run_names_an_environment_that_is_not_installed(tmp_path, tiny_model_dir):
    path = _config(tmp_path, tiny_model_dir, inference=1, trainer=1, args={"batch_size": 8, "rollouts_per_example": 4})
    assert "reverse-text (module reverse_text, installed)" in render(_plan(path, 0))
    text = render(_plan(path, 0, ["--env.id", "someone/no-such-env"]))
    assert "someone/no-such-env: NOT installed here" in text and "`prime env install someone/no-such-env`" in text


def test_rltrainer_in_a_script_plans_with_the_same_function(monkeypatch, tmp_path):
    """RLTrainer's own server (a script or a notebook on one GPU) comes from plan_run too: the split of the GPU it
    shares, or, since its model is built already, a refusal that names what to set."""
    import torch

    from verifiers_rl.plan.memory import _KNOWN_KEYS, KNOWN, ModelShape
    from verifiers_rl.plan.run import plan_run
    from verifiers_rl.serving.launcher import server_of
    from verifiers_rl.trainer import RLConfig

    class Props:  # one 24 GiB GPU, as torch.cuda describes it (the device is all that is faked)
        uuid, total_memory = "GPU-0", 24 << 30

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    shape = ModelShape.from_config(dict(zip(_KNOWN_KEYS, KNOWN["qwen3-0.6b"])))
    machine = probe_machine()
    assert (machine.gpus, machine.uuids, machine.real) == (1, ("GPU-0",), True)

    def args(**kw):
        return RLConfig(output_dir=str(tmp_path), use_cpu=True, server_engine="vllm", max_seq_len=512, **kw)

    run = plan_run(args(activation_checkpointing=True), "m", machine, shape=shape, apply=False)
    assert run.serving.shared_gpu and run.memory.measures == {}
    command = server_of(run).command()  # what ServerSession._spawn starts
    share = command[command.index("--gpu-memory-utilization") + 1]
    assert float(share) == pytest.approx(run.memory.gpu_memory_utilization)
    with pytest.raises(ConfigError, match="does not fit its GPU as configured: set activation_checkpointing=True"):
        plan_run(args(micro_batch_size=64), "m", machine, shape=shape, apply=False)

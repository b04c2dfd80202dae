"""`vf-rl @ cfg.toml [--section.key value ...] [--dry-run]`: server + trainer in one command.
`vf-rl setup [DIR] [--force]`: lay out a workspace (configs, endpoints, environments/AGENTS.md).
`vf-rl export CHECKPOINT OUT [--merge | --adapter]`: a checkpoint as a model to serve and share (scripts/export.py).

Order of work: resolve the model (build the tiny one, run the SFT warm-start if the config asks and it is not
done yet), assign GPUs (inference first, then trainer), start the inference server through the launcher, run
the trainer (in this process, or `accelerate launch` when it has several GPUs), evaluate before/after, and
write the reward curve. The server is stopped on every exit path.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from verifiers_rl.errors import ConfigError
from verifiers_rl.rl.plan.devices import assign_gpus, plan_memory
from verifiers_rl.rl.plan.serving import PLAN_ENV
from verifiers_rl.scripts.common import (
    flags_from_args,
    load_env,
    resolve_model,
    run_cli,
    split_argv,
    train_and_evaluate,
)
from verifiers_rl.scripts.toml_config import (
    apply_overrides,
    load,
    resolve_path,
    rl_config,
    validate,
)


@dataclass
class Plan:
    cfg: dict[str, Any]
    config_path: str
    overrides: list[str]
    model: str
    gpus: Any  # plan.devices.GpuPlan
    serving: Any  # plan.serving.ServingPlan
    output_dir: str
    server: Any  # InferenceServer, not started
    sft: dict[str, Any] | None = None
    trainer_cmd: list[str] = field(default_factory=list)
    trainer_overrides: dict[str, Any] = field(default_factory=dict)  # [trainer.args] values the plan pins

    @property
    def engine(self) -> str:
        return self.serving.engine

    @property
    def server_cmd(self) -> list[str]:
        return self.server.command()


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA setup means CPU here
        return 0


def build_plan(
    cfg: dict[str, Any],
    config_path: str,
    overrides: list[str],
    dry_run: bool,
    cuda: int | None = None,
    gpu_memory_gib: float | None = None,
) -> Plan:
    from verifiers_rl.rl.plan.serving import plan_serving, resolve_engine
    from verifiers_rl.scripts.sft import sft_plan

    sft = None
    if "sft" in cfg:
        sft = sft_plan(resolve_path(cfg["sft"]["config"], config_path), dry_run=dry_run)
        model = sft["final_dir"]
    else:
        model = resolve_model(cfg, config_path, dry_run=dry_run)
    real_cuda = _cuda_count()
    cuda = real_cuda if cuda is None else cuda
    gpus = assign_gpus(cfg, cuda)
    inf = cfg.get("inference", {})
    # planning for GPUs this machine does not have (--gpus N): assume the GPU machine has vLLM
    engine = resolve_engine(inf.get("engine", "auto"), cuda=cuda > 0, vllm=True if cuda > real_cuda else None)
    if engine == "vllm" and not cuda:
        raise ConfigError("inference.engine='vllm' needs CUDA devices; none are visible (use engine = \"cpu\")")
    # validates [trainer.args] now, before anything starts (precision checks need the real hardware)
    args = rl_config(cfg, cuda=cuda > 0 and real_cuda > 0, quiet=cuda > real_cuda, server_engine=engine)
    gpu_bytes = int((gpu_memory_gib or _gpu_gib(real_cuda)) * (1 << 30))
    serving = plan_serving(
        args,
        mode="spawn",
        engine=engine,
        cuda_count=cuda,
        trainer_devices=gpus.trainer,
        server_gpus=gpus.inference or None,
        data_parallel=gpus.data_parallel,
        memory=lambda: plan_memory(cfg, args, model, gpu_bytes, base=sft["cfg"]["model"] if sft else None),
    )
    pinned = serving.trainer_args(args.use_lora)
    args = rl_config(cfg, cuda=cuda > 0 and real_cuda > 0, quiet=True, **pinned)
    procs = gpus.trainer_processes
    if args.batch_size % (args.micro_batch_size * procs):
        raise ConfigError(
            f"trainer.args.batch_size={args.batch_size} must be divisible by micro_batch_size * trainer processes "
            f"= {args.micro_batch_size} * {procs} (trainer.gpus)"
        )
    server = make_server(cfg, args, model, serving)
    plan = Plan(cfg, config_path, overrides, model, gpus, serving, args.output_dir, server, sft)
    plan.trainer_overrides = pinned
    if len(gpus.trainer) > 1:
        plan.trainer_cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            str(len(gpus.trainer)),
            "-m",
            "verifiers_rl.scripts.train",
            "@",
            str(Path(config_path).resolve()),
            *overrides,
            *[a for key, value in pinned.items() for a in (f"--trainer.args.{key}", str(value))],
            "--inference.host",
            inf.get("host", "127.0.0.1"),
            "--inference.port",
            "<server port>",
        ]
    return plan


def _gpu_gib(real_cuda: int) -> float:
    """GiB of GPU 0, or 80 (an H100) when planning for GPUs this machine does not have (--gpu-memory sets it)."""
    if real_cuda:
        import torch

        return torch.cuda.get_device_properties(0).total_memory / (1 << 30)
    return 80.0


def make_server(cfg: dict[str, Any], args, model: str, serving):
    """The inference server of a vf-rl run, as its serving plan says (one definition for the plan and the run)."""
    from verifiers_rl.rl.inference.launcher import InferenceServer

    inf = cfg.get("inference", {})
    return InferenceServer(
        model,
        engine=serving.engine,
        host=inf.get("host", "127.0.0.1"),
        port=inf.get("port"),
        output_dir=args.output_dir,
        gpus=list(serving.server_gpus) if serving.server_gpus else None,
        max_model_len=args.server_max_len,
        data_parallel_size=serving.data_parallel,
        extra_args=serving.server_args(flags_from_args(inf.get("args", {}))),
        startup_timeout=inf.get("startup_timeout", args.vllm_server_timeout),
        env=serving.server_env(),
        weight_backend=serving.server_weight_backend,
    )


def print_plan(plan: Plan) -> None:
    print("# resolved config")
    print(json.dumps(plan.cfg, indent=2, default=str))
    print(f"\n# devices\n{plan.gpus.describe()}")
    print(f"\n# model\n{plan.model}")
    if plan.sft:
        state = "done, reused" if plan.sft["done"] else "runs first"
        print(f"\n# SFT warm-start ({state})\nvf-sft @ {plan.sft['config_path']}  ->  {plan.sft['final_dir']}")
    print("\n# serving plan\n" + "\n".join(plan.serving.describe()))
    dev = f"CUDA_VISIBLE_DEVICES={','.join(map(str, plan.gpus.inference))} " if plan.gpus.inference else ""
    print(f"\n# inference server (engine: {plan.engine})\n{dev}{shlex.join(plan.server_cmd)}")
    decided = ", ".join(f"{k} = {v!r}" for k, v in sorted(plan.trainer_overrides.items()))
    print(f"\n# the plan pins\n[trainer.args] {decided}")
    if plan.trainer_cmd:
        dev = f"CUDA_VISIBLE_DEVICES={','.join(map(str, plan.gpus.trainer))} "
        print(f"\n# trainer ({len(plan.gpus.trainer)} processes)\n{dev}{shlex.join(plan.trainer_cmd)}")
    else:
        where = f"on GPU {plan.gpus.trainer[0]}" if plan.gpus.trainer else "on the CPU"
        print(f"\n# trainer\nin this process, {where} (RLTrainer, connected to the server above)")
    print(f"\n# outputs\n{plan.output_dir} (final/ = the trained model, metrics.jsonl, reward_curve.png, checkpoints)")


def run(plan: Plan) -> int:
    cfg = plan.cfg
    if plan.sft and not plan.sft["done"]:
        from verifiers_rl.scripts.sft import run_sft

        run_sft(plan.sft["cfg"], plan.sft["config_path"])
    env = load_env(cfg)
    server = plan.server
    pinned = plan.trainer_overrides
    if plan.engine == "vllm" and plan.serving.lora_sync == "adapter" and not plan.trainer_cmd:
        # vLLM registers the served adapter at startup from the trainer's step-0 LoRA weights: the trainer
        # (one process) starts this server itself, with the same flags, once its model is wrapped
        spec = server.spec
        server_args = list(spec.extra_args)
        if spec.data_parallel_size > 1:
            server_args += ["--data-parallel-size", str(spec.data_parallel_size)]
        args = rl_config(
            cfg,
            server_mode="spawn",
            server_gpus=spec.gpus,
            server_args=server_args,
            server_max_model_len=spec.max_model_len,
            vllm_server_host=spec.host,
            vllm_server_port=spec.port,
            **pinned,
        )
        print("vf-rl: the trainer starts the vllm inference server (adapter sync)", flush=True)
        return train_and_evaluate(plan.model, env, args, cfg)
    print(f"vf-rl: starting the {plan.engine} inference server (log: {server.log_path})", flush=True)
    with server:
        if plan.trainer_cmd:
            return _run_accelerate(plan, server)
        args = rl_config(
            cfg,
            server_mode="connect",
            vllm_server_host=server.host,
            vllm_server_port=server.port,
            server_control_token=server.token,
            **pinned,
        )
        return train_and_evaluate(plan.model, env, args, cfg, server, plan.serving)


def _run_accelerate(plan: Plan, server) -> int:
    cmd = [str(server.port) if a == "<server port>" else a for a in plan.trainer_cmd]
    env = {
        **os.environ,
        "VF_CONTROL_TOKEN": server.token,
        "CUDA_VISIBLE_DEVICES": ",".join(map(str, plan.gpus.trainer)),
        PLAN_ENV: plan.serving.to_json(),  # the trainer processes run by this plan, not one of their own
    }
    print(f"vf-rl: {shlex.join(cmd)}", flush=True)
    return subprocess.call(cmd, env=env)


def main(argv: list[str] | None = None) -> NoReturn:
    """Console-script entry point. It raises SystemExit(code) itself: verifiers' own `vf-*` scripts call `main()`
    and drop its return value, and whichever package was installed last owns the script name."""
    raise SystemExit(run_command(argv))


def run_command(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["setup"]:
        from verifiers_rl.scripts.setup import run_setup

        return run_setup(argv[1:])
    if argv[:1] == ["export"]:
        from verifiers_rl.scripts.export import run_export

        return run_export(argv[1:])

    def body() -> int:
        path, overrides, flags = split_argv(argv, "vf-rl")
        cfg = validate(apply_overrides(load(path), overrides), "vf-rl")
        dry = "--dry-run" in flags
        gpus = next((int(f.split("=")[1]) for f in flags if f.startswith("--gpus=")), None)
        if gpus is not None and not dry:
            raise ConfigError("--gpus only plans (with --dry-run); a real run uses the visible CUDA devices")
        memory = next((float(f.split("=")[1]) for f in flags if f.startswith("--gpu-memory=")), None)
        plan = build_plan(cfg, path, overrides, dry_run=dry, cuda=gpus, gpu_memory_gib=memory)
        if dry:
            print_plan(plan)
            return 0
        code = run(plan)
        out = Path(plan.output_dir)
        print(
            f"vf-rl: done. model: {out / 'final'}  metrics: {out / 'metrics.jsonl'}  "
            f"curve: {out / 'reward_curve.png'}  checkpoints: {out}/checkpoint-*  "
            f"server log: {out / 'logs' / 'inference.log'}"
        )
        return code

    return run_cli("vf-rl", body)


if __name__ == "__main__":
    main()

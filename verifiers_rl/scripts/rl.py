"""`vf-rl @ cfg.toml [--section.key value ...] [--dry-run]`: server + trainer in one command.
`vf-rl setup [DIR] [--force]`: lay out a workspace (configs, endpoints, environments/AGENTS.md).

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

from verifiers_rl.scripts.common import (
    flags_from_args,
    load_env,
    resolve_model,
    run_cli,
    split_argv,
    train_and_evaluate,
)
from verifiers_rl.scripts.devices import assign_gpus, plan_memory
from verifiers_rl.scripts.toml_config import (
    ConfigError,
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
    engine: str
    gpus: Any
    output_dir: str
    server: Any  # InferenceServer, not started
    sft: dict[str, Any] | None = None
    trainer_cmd: list[str] = field(default_factory=list)
    memory: Any = None  # shared_gpu.SharedGpuPlan of a one-GPU layout
    trainer_overrides: dict[str, Any] = field(default_factory=dict)  # what the layout decides for [trainer.args]

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
    from verifiers_rl.rl.inference.layout import resolve_engine
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
    layout = {}
    if gpus.shared:
        # no NCCL between two ranks on one device: weights go through host memory, adapters by default
        layout["sync_backend"] = "gloo"
        if (
            args.use_lora
            and "lora_sync" not in cfg.get("trainer", {}).get("args", {})
            and not args.lora_modules_to_save
        ):
            layout["lora_sync"] = "adapter"
        args = rl_config(cfg, cuda=cuda > 0 and real_cuda > 0, quiet=True, server_engine=engine, **layout)
    procs = gpus.trainer_processes
    if args.batch_size % (args.micro_batch_size * procs):
        raise ConfigError(
            f"trainer.args.batch_size={args.batch_size} must be divisible by micro_batch_size * trainer processes "
            f"= {args.micro_batch_size} * {procs} (trainer.gpus)"
        )
    memory = None
    if gpus.shared and engine == "vllm":
        gpu_bytes = int((gpu_memory_gib or _gpu_gib(real_cuda)) * (1 << 30))
        memory = plan_memory(cfg, args, model, gpu_bytes, base=sft["cfg"]["model"] if sft else None)
    plan = Plan(
        cfg,
        config_path,
        overrides,
        model,
        engine,
        gpus,
        args.output_dir,
        make_server(cfg, args, model, gpus, memory),
        sft,
        memory=memory,
        trainer_overrides=layout,
    )
    n_trainer = len(gpus.trainer)
    if n_trainer > 1:
        plan.trainer_cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            str(n_trainer),
            "-m",
            "verifiers_rl.scripts.train",
            "@",
            str(Path(config_path).resolve()),
            *overrides,
            *[a for key, value in layout.items() for a in (f"--trainer.args.{key}", str(value))],
            "--inference.host",
            inf.get("host", "127.0.0.1"),
            "--inference.port",
            "<server port>",
        ]
    return plan


def _server_flags(inference_args: dict[str, Any], memory) -> list[str]:
    flags = flags_from_args(inference_args)
    if memory is not None and "gpu_memory_utilization" not in inference_args:
        flags += ["--gpu-memory-utilization", f"{memory.gpu_memory_utilization:.2f}"]
    return flags


def _gpu_gib(real_cuda: int) -> float:
    """GiB of GPU 0, or 80 (an H100) when planning for GPUs this machine does not have (--gpu-memory sets it)."""
    if real_cuda:
        import torch

        return torch.cuda.get_device_properties(0).total_memory / (1 << 30)
    return 80.0


def make_server(cfg: dict[str, Any], args, model: str, gpus, memory=None):
    """The inference server of a vf-rl run (one definition for the plan and the run)."""
    from verifiers_rl.rl.inference.launcher import InferenceServer
    from verifiers_rl.rl.trainer.runtime import cpu_thread_split, server_thread_env

    inf = cfg.get("inference", {})
    return InferenceServer(
        model,
        engine=args.server_engine,
        host=inf.get("host", "127.0.0.1"),
        port=inf.get("port"),
        output_dir=args.output_dir,
        gpus=gpus.inference or None,
        max_model_len=args.server_max_len,
        data_parallel_size=gpus.data_parallel,
        extra_args=_server_flags(inf.get("args", {}), memory),
        startup_timeout=inf.get("startup_timeout", args.vllm_server_timeout),
        env=server_thread_env(cpu_thread_split(args)),
    )


def print_plan(plan: Plan) -> None:
    print("# resolved config")
    print(json.dumps(plan.cfg, indent=2, default=str))
    print(f"\n# devices\n{plan.gpus.describe()}")
    print(f"\n# model\n{plan.model}")
    if plan.sft:
        state = "done, reused" if plan.sft["done"] else "runs first"
        print(f"\n# SFT warm-start ({state})\nvf-sft @ {plan.sft['config_path']}  ->  {plan.sft['final_dir']}")
    dev = f"CUDA_VISIBLE_DEVICES={','.join(map(str, plan.gpus.inference))} " if plan.gpus.inference else ""
    print(f"\n# inference server (engine: {plan.engine})\n{dev}{shlex.join(plan.server_cmd)}")
    if plan.memory is not None:
        print("\n# one GPU\n" + "\n".join(plan.memory.describe()))
    if plan.trainer_overrides:
        why = "server and trainer share a GPU: weights go through host memory"
        decided = ", ".join(f"{k} = {v!r}" for k, v in plan.trainer_overrides.items())
        print(f"\n# layout decides\n[trainer.args] {decided} ({why})")
    if plan.trainer_cmd:
        dev = f"CUDA_VISIBLE_DEVICES={','.join(map(str, plan.gpus.trainer))} "
        print(f"\n# trainer ({len(plan.gpus.trainer)} processes)\n{dev}{shlex.join(plan.trainer_cmd)}")
    else:
        where = f"on GPU {plan.gpus.trainer[0]}" if plan.gpus.trainer else "on the CPU"
        print(f"\n# trainer\nin this process, {where} (RLTrainer, connected to the server above)")
    print(f"\n# outputs\n{plan.output_dir} (metrics.jsonl, reward_curve.png, checkpoints, logs/inference.log)")


def run(plan: Plan) -> int:
    cfg = plan.cfg
    if plan.sft and not plan.sft["done"]:
        from verifiers_rl.scripts.sft import run_sft

        run_sft(plan.sft["cfg"], plan.sft["config_path"])
    env = load_env(cfg)
    server = plan.server
    layout = plan.trainer_overrides
    if plan.engine == "vllm" and rl_config(cfg, **layout).lora_sync == "adapter" and not plan.trainer_cmd:
        # vLLM registers the served adapter at startup from the trainer's step-0 LoRA weights: the trainer
        # (one process) starts this server itself, with the same flags, once its model is wrapped
        spec = server.spec
        server_args = list(spec.extra_args)
        if spec.data_parallel_size > 1:
            server_args += ["--data-parallel-size", str(spec.data_parallel_size)]
        args = rl_config(
            cfg,
            server_mode="spawn",
            server_engine="vllm",
            server_gpus=spec.gpus,
            server_args=server_args,
            server_max_model_len=spec.max_model_len,
            vllm_server_host=spec.host,
            vllm_server_port=spec.port,
            **layout,
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
            server_engine=plan.engine,
            **layout,
        )
        return train_and_evaluate(plan.model, env, args, cfg, server)


def _run_accelerate(plan: Plan, server) -> int:
    cmd = [str(server.port) if a == "<server port>" else a for a in plan.trainer_cmd]
    env = {
        **os.environ,
        "VF_CONTROL_TOKEN": server.token,
        "CUDA_VISIBLE_DEVICES": ",".join(map(str, plan.gpus.trainer)),
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
            f"vf-rl: done. metrics: {out / 'metrics.jsonl'}  curve: {out / 'reward_curve.png'}  "
            f"checkpoints: {out}/checkpoint-*  server log: {out / 'logs' / 'inference.log'}"
        )
        return code

    return run_cli("vf-rl", body)


if __name__ == "__main__":
    main()

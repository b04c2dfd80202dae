"""`vf-rl @ cfg.toml [--section.key value ...] [--dry-run]`: server + trainer in one command.
`vf-rl setup [DIR] [--force]`: lay out a workspace (configs, endpoints, environments/AGENTS.md).
`vf-rl export CHECKPOINT OUT [--merge | --adapter]`: a checkpoint as a model to serve and share (scripts/export.py).

Order of work (the plan is `rl_plan.py`'s): resolve the model (build the tiny one, run the SFT warm-start in a
process of its own on the trainer's GPUs if the config asks and it is not done yet), assign GPUs (inference first,
then trainer), start the inference server through the launcher, run the trainer (in this process on a CPU; on GPUs
in processes of its own, narrowed to its GPUs, under `accelerate launch` when it has several), evaluate
before/after, and write the reward curve. The server is stopped on every exit path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

from verifiers_rl.config.run_file import RunFile
from verifiers_rl.errors import ConfigError
from verifiers_rl.plan.run import probe_machine
from verifiers_rl.scripts.common import (
    USAGE,
    evaluate_base,
    load_env,
    resolve_model,
    run_cli,
    split_argv,
    train_and_evaluate,
)
from verifiers_rl.scripts.preflight import preflight
from verifiers_rl.scripts.rl_plan import Plan, build_plan, render, trainer_env


def run(plan: Plan) -> int:
    run_file = plan.run_file
    env = plan.env if plan.env is not None else load_env(run_file)
    if plan.resume is not None and plan.resume.kind == "restart":
        from verifiers_rl.export.run_settings import start_over

        removed = start_over(plan.output_dir)
        print(f"vf-rl: {plan.resume.line()} ({', '.join(removed)})", flush=True)
    base = None
    if plan.sft and run_file.eval.base and plan.trainer_cmd:
        print("vf-rl: [eval] base is evaluated only when the trainer runs in this process (CPU runs)", flush=True)
    elif plan.sft and run_file.eval.base:
        model = resolve_model(plan.sft.file)
        args = plan.args.derive(server_mode="spawn", output_dir=str(Path(plan.output_dir) / "base-eval"))
        base = evaluate_base(model, env, args, run_file.eval)
    if plan.sft and not plan.sft.done:  # a process of its own, on the trainer's GPUs (none on a CPU)
        from verifiers_rl.scripts.sft import run_sft_process

        run_sft_process(plan.sft.config_path, plan.visible(plan.gpus.trainer))
    server = plan.server
    if server.spec.adapter is not None:
        from verifiers_rl.sync.transport.adapter import write_zero_adapter

        write_zero_adapter(plan.model, plan.args, server.spec.adapter.path)
    print(f"vf-rl: starting the {plan.engine} inference server (log: {server.log_path})", flush=True)
    if ignored := plan.ignored_flags():
        print(f"vf-rl: the CPU engine ignores vLLM-only flags: {' '.join(ignored)}", flush=True)
    with server:
        if plan.trainer_cmd:
            return _run_trainer_processes(plan, server)
        # the trainer connects to the server just started: a config derived from the plan's, which stays as printed
        args = plan.args.derive(server_mode="connect", vllm_server_port=server.port, server_control_token=server.token)
        return train_and_evaluate(plan.model, env, args, run_file, server, plan.serving, base)


def _run_trainer_processes(plan: Plan, server) -> int:
    print(f"vf-rl: {plan.trainer_line()}", flush=True)
    trainer = subprocess.Popen(plan.trainer_cmd, env={**os.environ, **trainer_env(plan, server.token, server.port)})
    return supervise(trainer, server, plan.args.server_restarts)


def supervise(trainer: subprocess.Popen, server, restarts: int, poll_s: float = 1.0) -> int:
    """Wait for the trainer processes; a server that dies meanwhile is started again (same port and token, up to
    `restarts` times), and the trainers, connected to it, wait for it (`server_restart_grace`) and sync into it."""
    done = 0
    while True:
        try:
            return trainer.wait(poll_s)
        except subprocess.TimeoutExpired:
            pass
        status = server.status()
        if status and "is stopped" not in status and done < restarts:
            done += 1
            print(f"vf-rl: {status}; restarting it ({done} of {restarts}), log: {server.log_path}", flush=True)
            try:
                server.restart()
            except Exception as e:  # noqa: BLE001 - the trainers stop by themselves after their grace period
                print(f"vf-rl: the inference server did not start again: {e}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> NoReturn:
    """Console-script entry point. It raises SystemExit(code) itself: verifiers' own `vf-*` scripts call `main()`
    and drop its return value, and whichever package was installed last owns the script name."""
    raise SystemExit(run_command(argv))


def run_command(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE["vf-rl"], file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[:1] == ["setup"]:
        from verifiers_rl.scripts.setup import run_setup

        return run_setup(argv[1:])
    if argv[:1] == ["export"]:
        from verifiers_rl.scripts.export import run_export

        return run_export(argv[1:])

    def body() -> int:
        path, overrides, flags = split_argv(argv, "vf-rl")
        run_file = RunFile.read(path, overrides, "vf-rl")
        dry = "--dry-run" in flags
        gpus = next((int(f.split("=")[1]) for f in flags if f.startswith("--gpus=")), None)
        if gpus is not None and not dry:
            raise ConfigError("--gpus only plans (with --dry-run); a real run uses the visible CUDA devices")
        memory = next((float(f.split("=")[1]) for f in flags if f.startswith("--gpu-memory=")), None)
        nodes = next((int(f.split("=")[1]) for f in flags if f.startswith("--nodes=")), None)
        if nodes is not None:
            if not dry or gpus is None:
                raise ConfigError("--nodes only plans (with --dry-run --gpus <per node>): run the printed commands")
            from verifiers_rl.scripts.rl_nodes import print_nodes

            print_nodes(run_file, overrides, nodes, gpus)
            return 0
        plan = build_plan(run_file, lambda: probe_machine(gpus, memory), dry_run=dry)
        finished = plan.resume is not None and plan.resume.kind == "finished"
        if gpus is not None:  # a plan for another machine: this one's environments, logins and files say nothing
            plan.checks = ["not checked: --gpus plans for another machine (its --dry-run without --gpus checks there)"]
        elif not finished:  # a finished run starts nothing, so it needs nothing checked
            plan.checks = preflight(plan)
        if dry:
            print(render(plan))
            return 0
        if finished:
            print(f"vf-rl: {plan.resume.line()}", flush=True)
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

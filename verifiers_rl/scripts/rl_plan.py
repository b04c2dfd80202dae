"""`vf-rl`'s plan: the run plan (`rl.plan.run.plan_run`) plus what only a command has: the SFT warm-start, the
config file's model, and the trainer's own command on GPUs. `--dry-run` prints `render(plan)`; `vf-rl` launches
`plan.server` and `plan.trainer_cmd`, the same objects; the trainer processes get their inputs from the plan
(`rank_inputs`), never from the config file.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verifiers_rl.config.checks import describe_sampling, uneven_split
from verifiers_rl.config.run_file import RunFile, build_rl_config
from verifiers_rl.errors import ConfigError
from verifiers_rl.export.run_settings import Resume, decide, env_identity, run_settings
from verifiers_rl.plan.devices import child_visible_devices
from verifiers_rl.plan.run import PLAN_ENV, Layout, Machine, RunPlan, plan_run
from verifiers_rl.scripts.common import resolve_model, wants_resume
from verifiers_rl.serving.launcher import server_of

if TYPE_CHECKING:
    from verifiers_rl.scripts.sft import SftPlan

FROM_PLAN = "--from-plan"  # the trainer processes' one argument: what they train with is in $VF_RUN_PLAN


@dataclass
class Plan:
    run_file: RunFile  # the config as read and checked once, with the command line's overrides
    run: RunPlan
    sft: SftPlan | None = None
    arguments: dict[str, Any] = field(default_factory=dict)  # the RLConfig arguments the config gives (rl_arguments)
    trainer_cmd: list[str] = field(default_factory=list)  # empty: the trainer runs in vf-rl's process (CPU)
    resume: Resume | None = None  # new run, resume, finished or restart (changed settings stop in build_plan)
    checks: list[str] = field(default_factory=list)  # what preflight.py checked before anything started
    env: Any = None  # the environment, loaded by the checks

    # the run plan's parts, by the names the launcher and the tests use
    model = property(lambda self: self.run.model)
    gpus = property(lambda self: self.run.gpus)
    serving = property(lambda self: self.run.serving)
    args = property(lambda self: self.run.args)
    server = property(lambda self: self.run.server)
    engine = property(lambda self: self.run.engine)
    output_dir = property(lambda self: self.run.args.output_dir)
    config_path = property(lambda self: self.run_file.path)

    def visible(self, indices: list[int]) -> str:
        """CUDA_VISIBLE_DEVICES of a process that gets `indices` of the GPUs vf-rl sees."""
        return ",".join(map(str, indices)) if not self.run.machine.real else child_visible_devices(indices)

    def ignored_flags(self) -> list[str]:
        """The server's flags the CPU engine does not take (vLLM-only, e.g. from [inference.args]): it ignores them,
        and says so in its log only; vf-rl says so on the console."""
        if self.engine != "cpu":
            return []
        from verifiers_rl.inference.server import build_parser

        cmd = self.server.command()
        args = ["0" if a.startswith("<") else a for a in cmd[cmd.index("verifiers_rl.inference.server") + 1 :]]
        return build_parser().parse_known_args(args)[1]  # a planned port ("<free port>") parses as a number

    def server_line(self) -> str:
        dev = f"CUDA_VISIBLE_DEVICES={self.visible(self.gpus.inference)} " if self.gpus.inference else ""
        return dev + shlex.join(self.server.command())

    def trainer_line(self) -> str:
        return f"CUDA_VISIBLE_DEVICES={self.visible(self.gpus.trainer)} {shlex.join(self.trainer_cmd)}"


def check_model(model: str, dry_run: bool) -> None:
    """A model that cannot be found fails now, before torch is imported and anything starts (a dry run plans
    for another machine: it checks local paths only)."""
    from verifiers_rl.model_source import looks_like_path, resolve_model_path

    if dry_run and not (looks_like_path(model) or Path(model).exists()):
        return
    try:
        resolve_model_path(model)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model = {model!r}: {e}") from None


def build_plan(run_file: RunFile, machine: Machine | Callable[[], Machine], dry_run: bool) -> Plan:
    """`machine`, or a function that probes it: called once the model is known to exist (probing imports torch,
    and a missing model is reported in well under a second)."""
    from verifiers_rl.plan.memory import shape_of
    from verifiers_rl.scripts.sft import sft_plan

    tiny = _tiny_shape(run_file)  # the offline tiny model's shape, known before it is built
    sft = None
    if run_file.sft_file is not None:
        sft = sft_plan(run_file.sft_file)
        model = sft.final_dir
    else:
        model = resolve_model(run_file, dry_run=dry_run)
        if not (dry_run and run_file.model == "tiny"):  # a dry run builds nothing; the tiny model is built offline
            check_model(model, dry_run)
    machine = machine() if callable(machine) else machine
    # validates [trainer.args] now, before anything starts (precision checks need the real hardware)
    arguments = run_file.rl_arguments()
    args = build_rl_config(arguments, cuda=machine.gpus > 0 and machine.real, quiet=not machine.real)
    layout = Layout(
        inference_gpus=run_file.inference.gpus,
        trainer_gpus=run_file.trainer.gpus,
        accelerate_config=run_file.accelerate_config(),
    )
    shape = shape_of(model) or (shape_of(sft.file.model) if sft else None) or tiny
    user_set = frozenset(run_file.trainer.args)
    run = plan_run(args, model, machine, layout, shape=shape, user_set=user_set)
    run.server, args = server_of(run), run.args  # the RLConfig with what the memory fit chose
    # RLConfig checked this in one process; the plan knows how many the trainer will run in
    if uneven := uneven_split(args.batch_size, args.micro_batch_size, run.gpus.trainer_processes, "trainer processes"):
        raise ConfigError(f"trainer.args.batch_size={args.batch_size} {uneven} (trainer.gpus)")
    plan = Plan(run_file, run, sft, arguments)
    plan.resume = plan_resume(run_file, args, model)
    if run.gpus.trainer:  # every GPU layout: the trainer in processes of its own, on its own GPUs
        launch = launcher_args(len(run.gpus.trainer), layout.accelerate_config)
        plan.trainer_cmd = trainer_command(launch)
    return plan


def plan_resume(run_file: RunFile, args, model: str) -> Resume:
    """What this run does with output_dir's checkpoints, decided as the trainer decides it (run_settings.decide):
    changed settings stop here, before anything starts, with the line the trainer would raise."""
    settings = run_settings(args, model, env_identity(run_file.env_spec()))
    resume = decide(args.output_dir, settings, args.max_steps, args.on_settings_change, wants_resume(args))
    if resume.stops:
        raise ConfigError(resume.line())
    return resume


def _tiny_shape(run_file: RunFile):
    """The offline tiny model's shape, from its spec, before it is built."""
    if run_file.model != "tiny":
        return None
    from verifiers_rl.plan.memory import ModelShape
    from verifiers_rl.tiny import build_config, build_tokenizer

    return ModelShape.from_config(build_config(build_tokenizer(), run_file.tiny_spec()))


def launcher_args(processes: int, accelerate_config: str | None = None) -> list[str]:
    """How the trainer's processes start: one plain process, or `accelerate launch` (the user's accelerate config,
    e.g. DeepSpeed ZeRO-3 or FSDP2, or plain multi-GPU data parallel)."""
    if accelerate_config:
        return [
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            accelerate_config,
            "--num_processes",
            str(processes),
        ]
    if processes > 1:
        return ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes)]
    return []


def trainer_command(launch: list[str]) -> list[str]:
    """The trainer's command on GPUs: `vf-train` for one process, under `accelerate launch` for several or for an
    accelerate config (`launcher_args`). Never in vf-rl's own process, which sees every GPU: CUDA_VISIBLE_DEVICES
    must narrow the trainer to its GPUs before CUDA starts (one process with several visible GPUs would take
    cuda:0, the server's, and Trainer would spread it with nn.DataParallel). vf-rl runs it with
    CUDA_VISIBLE_DEVICES, the control token and the plan set (`trainer_env`): the processes read no config file."""
    return [sys.executable, *launch, "-m", "verifiers_rl.scripts.train", FROM_PLAN]


def rank_inputs(plan: Plan, port: int | None = None) -> dict[str, Any]:
    """What a trainer process trains with, resolved and checked here once: the config (validated, overrides and
    aliases applied), the model (the SFT warm-start's, the tiny one built), and the RLConfig arguments (the
    config's, what the memory fit chose, the server's address). The process builds its RLConfig from them on its
    own hardware (`config.toml.build_rl_config`: CPU or CUDA, bf16 or not)."""
    address = {"vllm_server_host": plan.args.vllm_server_host, "server_mode": "connect"}
    if port is not None:  # the port the server got (a free one, unless the config fixes it)
        address["vllm_server_port"] = port
    return {
        "config": plan.run_file.as_dict(),
        "model": plan.model,
        "args": {**plan.arguments, **plan.run.measures, **address},
    }


def trainer_env(plan: Plan, token: str, port: int | None = None) -> dict[str, str]:
    """What the trainer processes get besides vf-rl's environment: their GPUs, the server's control token, and
    the plan with their inputs, once (they follow it instead of making their own)."""
    from verifiers_rl.serving.recovery import RUN_COMMAND_ENV

    return {
        RUN_COMMAND_ENV: shlex.join(["vf-rl", *sys.argv[1:]]),  # what a trainer that must stop says to run again
        "VF_CONTROL_TOKEN": token,
        "CUDA_VISIBLE_DEVICES": plan.visible(plan.gpus.trainer),
        PLAN_ENV: plan.run.for_ranks(rank_inputs(plan, port)),
    }


def render(plan: Plan) -> str:
    """What `vf-rl --dry-run` prints: the plan that `vf-rl` launches, from the same object."""
    out = ["# resolved config", json.dumps(plan.run_file.as_dict(), indent=2)]
    from verifiers_rl.scripts.environments import environments_status

    out += ["", "# devices", plan.gpus.describe(plan.engine), "", "# model", plan.model]
    out += ["", "# environment", *environments_status(plan.run_file.env)]
    out += ["", "# checked before anything starts", *plan.checks]
    if plan.sft:
        state = "done, reused" if plan.sft.done else "runs first"
        from verifiers_rl.scripts.sft import sft_line

        cmd = sft_line(plan.sft.config_path, plan.visible(plan.gpus.trainer))
        out += ["", f"# SFT warm-start ({state}, a process of its own -> {plan.sft.final_dir})", cmd]
    out += ["", "# sampling (every request states all of it)", describe_sampling(plan.args.sampling_args)]
    out += ["", "# serving plan", *plan.run.describe()]
    out += ["", f"# inference server (engine: {plan.engine})", plan.server_line()]
    if ignored := plan.ignored_flags():
        out.append(f"the CPU engine ignores vLLM-only flags: {' '.join(ignored)}")
    if plan.trainer_cmd:
        n = len(plan.gpus.trainer)
        head = f"# trainer ({n} process{'es' if n > 1 else ''}; the run plan and the resolved config in ${PLAN_ENV})"
        out += ["", head, plan.trainer_line()]
    else:
        out += ["", "# trainer", "in this process, on the CPU (RLTrainer, connected to the server above)"]
    out += [
        "",
        "# outputs",
        f"{os.path.abspath(plan.output_dir)} (final/ = the trained model, metrics.jsonl, reward_curve.png, "
        "checkpoints)",
        "",
        "# this run",
        plan.resume.line() if plan.resume else "a new run",
    ]
    return "\n".join(out)

"""`vf-rl`'s plan: what a run will start and how, computed before anything starts (`--dry-run` prints it).

The model (the tiny one built, the SFT warm-start's output), the GPUs of each process (`rl.plan.devices`), the
serving plan (`rl.plan.serving`: engine, shared GPU, LoRA sync, backend, memory split), the server's command, and
the trainer's: in vf-rl's process on a CPU, in processes of its own on GPUs.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verifiers_rl.errors import ConfigError
from verifiers_rl.rl.plan.devices import assign_gpus, child_visible_devices, plan_memory, planned_uuids
from verifiers_rl.rl.plan.serving import PLAN_ENV
from verifiers_rl.scripts.common import flags_from_args, resolve_model
from verifiers_rl.scripts.toml_config import resolve_path, rl_config


@dataclass
class Plan:
    cfg: dict[str, Any]
    config_path: str
    overrides: list[str]
    model: str
    gpus: Any  # plan.devices.GpuPlan
    serving: Any  # plan.serving.ServingPlan
    args: Any  # the trainer's RLConfig as planned (the pinned values applied), checked once here
    server: Any  # InferenceServer, not started
    sft: dict[str, Any] | None = None
    trainer_cmd: list[str] = field(default_factory=list)
    trainer_overrides: dict[str, Any] = field(default_factory=dict)  # [trainer.args] values the plan pins
    elsewhere: bool = False  # planned for GPUs this machine does not have (`--gpus N`): indices as they are there
    accelerate_config: str | None = None  # [trainer] accelerate_config, resolved
    ranks: Any = None  # plan.ranks.RankMemory of one trainer rank (None: the model's shape is unknown here)

    @property
    def output_dir(self) -> str:
        return self.args.output_dir

    def visible(self, indices: list[int]) -> str:
        """CUDA_VISIBLE_DEVICES of a process that gets `indices` of the GPUs vf-rl sees."""
        return ",".join(map(str, indices)) if self.elsewhere else child_visible_devices(indices)

    @property
    def engine(self) -> str:
        return self.serving.engine

    @property
    def server_cmd(self) -> list[str]:
        return self.server.command()


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
        check_model(model, dry_run)
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
    gpu_bytes = int((gpu_memory_gib or _gpu_gib(real_cuda, (gpus.inference or [0])[0])) * (1 << 30))
    serving = plan_serving(
        args,
        mode="spawn",
        engine=engine,
        cuda_count=cuda,
        server_uuids=planned_uuids(gpus.inference, real=cuda <= real_cuda) if cuda else None,
        trainer_uuids=planned_uuids(gpus.trainer, real=cuda <= real_cuda),
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
    plan = Plan(cfg, config_path, overrides, model, gpus, serving, args, server, sft)
    plan.trainer_overrides, plan.elsewhere = pinned, cuda > real_cuda
    plan.accelerate_config = _accelerate_config(cfg, config_path)
    if gpus.trainer:  # every GPU layout: the trainer in processes of its own, on its own GPUs (see trainer_command)
        plan.ranks = _rank_memory(plan, args, gpu_bytes)
        launch = launcher_args(len(gpus.trainer), plan.accelerate_config)
        plan.trainer_cmd = trainer_command(config_path, overrides, pinned, launch, inf.get("host"))
    return plan


def _accelerate_config(cfg: dict[str, Any], config_path: str) -> str | None:
    path = cfg.get("trainer", {}).get("accelerate_config")
    return str(Path(resolve_path(path, config_path)).resolve()) if path else None


def _rank_memory(plan: Plan, args, gpu_bytes: int):
    """One trainer rank's memory for the accelerate config's layout; a plan that cannot fit is refused (a GPU it
    shares with the server is planned by the shared-GPU planner instead)."""
    from verifiers_rl.rl.plan.memory import shape_of
    from verifiers_rl.rl.plan.ranks import check_fits, rank_memory, read_accelerate_config, training_layout

    config = read_accelerate_config(plan.accelerate_config) if plan.accelerate_config else None
    shape = shape_of(plan.model) or (shape_of(plan.sft["cfg"]["model"]) if plan.sft else None)
    if shape is None:
        return None
    memory = rank_memory(
        shape, layout=training_layout(config), ranks=len(plan.gpus.trainer), use_lora=args.use_lora,
        lora_rank=args.lora_rank, micro_batch_tokens=args.token_budget,
        gradient_checkpointing=bool(args.activation_checkpointing),
    )  # fmt: skip
    if not plan.serving.shared_gpu:
        check_fits(memory, gpu_bytes)
    return memory


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


def trainer_command(config_path: str, overrides: list[str], pinned: dict, launch: list[str], host: str | None):
    """The trainer's command on GPUs: `vf-train` for one process, under `accelerate launch` for several or for an
    accelerate config (`launcher_args`). Never in vf-rl's own process, which sees every GPU: CUDA_VISIBLE_DEVICES
    must narrow the trainer to its GPUs before CUDA starts (one process with several visible GPUs would take
    cuda:0, the server's, and Trainer would spread it with nn.DataParallel). vf-rl runs it with
    CUDA_VISIBLE_DEVICES, the control token and the plan set (`trainer_env`); "<server port>" becomes the port the
    server got."""
    return [
        sys.executable,
        *launch,
        "-m",
        "verifiers_rl.scripts.train",
        "@",
        str(Path(config_path).resolve()),
        *overrides,
        *[a for key, value in pinned.items() for a in (f"--trainer.args.{key}", str(value))],
        "--inference.host",
        host or "127.0.0.1",
        "--inference.port",
        "<server port>",
    ]


def trainer_env(plan: Plan, token: str) -> dict[str, str]:
    """What the trainer processes get besides vf-rl's environment: their GPUs, the server's control token, the
    serving plan (they follow it instead of making their own)."""
    from verifiers_rl.rl.trainer.server_recovery import RUN_COMMAND_ENV

    return {
        RUN_COMMAND_ENV: shlex.join(["vf-rl", *sys.argv[1:]]),  # what a trainer that must stop says to run again
        "VF_CONTROL_TOKEN": token,
        "CUDA_VISIBLE_DEVICES": plan.visible(plan.gpus.trainer),
        PLAN_ENV: plan.serving.to_json(),
    }


def _gpu_gib(real_cuda: int, gpu: int = 0) -> float:
    """GiB of the server's GPU, or 80 (an H100) when planning for GPUs this machine does not have (--gpu-memory)."""
    if real_cuda:
        import torch

        return torch.cuda.get_device_properties(gpu).total_memory / (1 << 30)
    return 80.0


def make_server(cfg: dict[str, Any], args, model: str, serving):
    """The inference server of a vf-rl run, as its serving plan says (one definition for the plan and the run)."""
    from verifiers_rl.rl.inference.launcher import InferenceServer
    from verifiers_rl.rl.inference.layout import ADAPTER_NAME, AdapterServing
    from verifiers_rl.rl.trainer.lora import lora_ranks

    inf = cfg.get("inference", {})
    adapter = None
    if serving.engine == "vllm" and serving.lora_sync == "adapter":
        # vLLM serves the policy as a LoRA adapter registered at startup: vf-rl writes a zero one of the trainer's
        # layout before the start (`run`), and the trainer's first sync fills it
        adapter = AdapterServing(ADAPTER_NAME, str(Path(args.output_dir) / "adapter_step0"), lora_ranks(args))
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
        adapter=adapter,
        weight_backend=serving.server_weight_backend,
    )


def print_plan(plan: Plan) -> None:
    print("# resolved config")
    print(json.dumps(plan.cfg, indent=2, default=str))
    print(f"\n# devices\n{plan.gpus.describe(plan.engine)}")
    print(f"\n# model\n{plan.model}")
    if plan.sft:
        state = "done, reused" if plan.sft["done"] else "runs first"
        print(f"\n# SFT warm-start ({state})\nvf-sft @ {plan.sft['config_path']}  ->  {plan.sft['final_dir']}")
    print("\n# serving plan\n" + "\n".join(plan.serving.describe()))
    dev = f"CUDA_VISIBLE_DEVICES={plan.visible(plan.gpus.inference)} " if plan.gpus.inference else ""
    print(f"\n# inference server (engine: {plan.engine})\n{dev}{shlex.join(plan.server_cmd)}")
    decided = ", ".join(f"{k} = {v!r}" for k, v in sorted(plan.trainer_overrides.items()))
    print(f"\n# the plan pins\n[trainer.args] {decided}")
    if plan.ranks is not None:
        print(f"\n# trainer memory\n{plan.ranks.describe()}")
    if plan.trainer_cmd:
        n = len(plan.gpus.trainer)
        dev = f"CUDA_VISIBLE_DEVICES={plan.visible(plan.gpus.trainer)} "
        print(f"\n# trainer ({n} process{'es' if n > 1 else ''}, the serving plan in ${PLAN_ENV})")
        print(f"{dev}{shlex.join(plan.trainer_cmd)}")
    else:
        print("\n# trainer\nin this process, on the CPU (RLTrainer, connected to the server above)")
    print(f"\n# outputs\n{plan.output_dir} (final/ = the trained model, metrics.jsonl, reward_curve.png, checkpoints)")

"""The run's plan: one function of (settings, machine) that every entry point calls.

`vf-rl` (and its `--dry-run`), `vf-train` and `RLTrainer(...)` in a script or a notebook all get the server they
start, the GPUs of each process, the weight sync and the memory split from `plan_run`. `--dry-run` prints the
`RunPlan` it returns and `vf-rl` launches that same object, so the printed commands are the launched ones.

    Machine   what the planner knows of the hardware: probed here (`probe_machine`, the one place the planner
              asks CUDA), or described by `vf-rl --dry-run --gpus N --gpu-memory G` for another machine
    Layout    where the processes go: [inference] gpus / [trainer] gpus / accelerate config (vf-rl), or the
              trainer's own process with the server on `server_gpus` (RLTrainer in a script)
    RunPlan   GPUs, the serving plan (serving.py), the memory fit (memory.py) and the RLConfig values it chose,
              the server to start (not started)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from verifiers_rl.config.choices import Engine
from verifiers_rl.errors import ConfigError
from verifiers_rl.plan.devices import GpuPlan, assign_gpus
from verifiers_rl.plan.layout import flag_value
from verifiers_rl.plan.memory import GIB, ModelShape
from verifiers_rl.plan.ranks import read_accelerate_config, training_layout
from verifiers_rl.plan.serving import ServingPlan, plan_serving, resolve_engine, vllm_installed

# A trainer process started by vf-rl finds the plan vf-rl made, and its resolved inputs, in this variable
# (`RunPlan.for_ranks`).
PLAN_ENV = "VF_RUN_PLAN"
PLANNED_GPU_BYTES = 80 * GIB  # a GPU of a machine planned for from here (--gpus N) without --gpu-memory: an H100


@dataclass(frozen=True)
class Machine:
    gpus: int  # CUDA devices this process sees (0: a CPU run)
    gpu_bytes: int = 0  # memory of one of them
    uuids: tuple[str, ...] = ()  # one name per GPU, the same in every process (UUIDs; "cuda:i" when planned)
    vllm: bool = False  # vLLM can be imported
    real: bool = True  # this machine; False: `vf-rl --dry-run --gpus N` plans for another one

    def names(self, indices) -> tuple[str, ...]:
        return tuple(self.uuids[int(i)] for i in indices)


def probe_machine(gpus: int | None = None, gpu_memory_gib: float | None = None) -> Machine:
    """This machine, or (`gpus` more than it has) the machine `vf-rl --dry-run --gpus N --gpu-memory G` plans for:
    indices are its GPUs' names there, and it is assumed to have vLLM."""
    found = _cuda_count()
    if gpus is not None and gpus > found:
        size = int((gpu_memory_gib or PLANNED_GPU_BYTES / GIB) * GIB)
        return Machine(gpus, size, tuple(f"cuda:{i}" for i in range(gpus)), vllm=True, real=False)
    count = found if gpus is None else gpus
    if not count:
        return Machine(0, vllm=vllm_installed())
    import torch

    props = [torch.cuda.get_device_properties(i) for i in range(count)]
    size = int(gpu_memory_gib * GIB) if gpu_memory_gib else props[0].total_memory
    return Machine(count, size, tuple(str(p.uuid) for p in props), vllm=vllm_installed())


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA setup means CPU here
        return 0


@dataclass(frozen=True)
class Layout:
    inference_gpus: int | None = None  # [inference] gpus (0: share the trainer's first GPU); None: RLTrainer's own
    trainer_gpus: int = 1
    accelerate_config: str | None = None  # resolved path of [trainer] accelerate_config


@dataclass
class RunPlan:
    model: str
    machine: Machine
    gpus: GpuPlan
    serving: ServingPlan
    memory: Any  # memory.MemoryFit; None on a CPU run
    args: Any  # the RLConfig the run trains with: the one planned for, derived with `measures` (RLConfig.derive)
    measures: dict[str, Any] = field(default_factory=dict)  # RLConfig values the memory fit chose
    server: Any = None  # the InferenceServer to start (serving.launcher.server_of), not started

    @property
    def engine(self) -> str:
        return self.serving.engine

    def for_ranks(self, trainer: dict[str, Any]) -> str:
        """What a trainer process that vf-rl starts gets: the serving plan and `trainer`, its resolved inputs (the
        config, the model, the RLConfig arguments: `scripts.rl_plan.rank_inputs`). It plans and reads nothing itself."""
        return json.dumps({"serving": json.loads(self.serving.to_json()), "trainer": trainer})

    def describe(self) -> list[str]:
        lines = list(self.serving.describe())
        if self.memory is not None:
            lines += self.memory.describe()
        return lines


def from_ranks_env() -> tuple[ServingPlan | None, dict[str, Any]]:
    """(serving plan, the trainer's inputs: config, model, RLConfig arguments) that vf-rl handed this trainer
    process, or (None, {})."""
    text = os.environ.get(PLAN_ENV)
    if not text:
        return None, {}
    data = json.loads(text)
    return ServingPlan.from_json(json.dumps(data["serving"])), dict(data.get("trainer") or {})


def plan_run(
    args,
    model: str,
    machine: Machine,
    layout: Layout = Layout(),
    *,
    shape: ModelShape | None = None,
    user_set: frozenset[str] | None = None,
    apply: bool = True,
) -> RunPlan:
    """The plan for `args` (an RLConfig) on `machine`. `shape`: the model's, for the memory fit (None: unknown;
    a GPU the server shares then needs the user's gpu_memory_utilization). `user_set`: the RLConfig fields the
    user wrote (None: those that differ from their defaults); the fit may choose the others. `apply`: the
    trainer has not read the chosen values yet (vf-rl plans before it starts the trainer); RLTrainer plans once
    its model is built, so a fit that needs a change is a refusal that names it."""
    gpus = _gpus(args, machine, layout)
    engine = resolve_engine(args.server_engine, cuda=machine.gpus > 0, vllm=machine.vllm)
    if engine == Engine.VLLM and not machine.gpus:
        raise ConfigError("server_engine / inference.engine = 'vllm' needs CUDA devices; none are visible (use 'cpu')")
    serving = plan_serving(
        args,
        mode="spawn",
        engine=engine,
        cuda_count=machine.gpus,
        server_uuids=machine.names(gpus.inference) if machine.gpus else None,
        trainer_uuids=machine.names(gpus.trainer),
        server_gpus=gpus.inference or None,
        data_parallel=gpus.data_parallel,
        post_processed=shape.post_processed if shape is not None else None,
    )
    memory = _fit(args, machine, layout, gpus, serving, shape, _user_set(args, user_set))
    measures = dict(memory.measures) if memory is not None else {}
    if measures and not apply:
        chosen = ", ".join(f"{k}={v!r}" for k, v in measures.items())
        raise ConfigError(f"the trainer does not fit its GPU as configured: set {chosen} ({'; '.join(memory.reasons)})")
    # a new RLConfig, checked again with the chosen values; the caller's stays as it was built
    return RunPlan(model, machine, gpus, serving, memory, args.derive(**measures) if measures else args, measures)


def _gpus(args, machine: Machine, layout: Layout) -> GpuPlan:
    tp = int(flag_value(args.server_args or [], "tensor-parallel-size") or 1)
    if layout.inference_gpus is not None:
        return assign_gpus(machine.gpus, layout.inference_gpus, layout.trainer_gpus, tp)
    if not machine.gpus:
        return GpuPlan(0, [], [])
    # RLTrainer in a script: this process trains on its current GPU; the server goes where server_gpus says
    import torch

    mine = torch.cuda.current_device() if machine.real else 0
    server = list(args.server_gpus) if args.server_gpus is not None else [0]
    return GpuPlan(machine.gpus, server, [mine], shared=mine in server)


def _fit(args, machine, layout, gpus, serving, shape, user_set: frozenset[str]):
    """The trainer's memory on its GPU (`memory.MemoryFit`), and vLLM's share of a GPU it shares with the trainer."""
    if not machine.gpus or not gpus.trainer:
        return None
    if layout.inference_gpus is None and not serving.shared_gpu:
        # RLTrainer in a running process (perhaps one rank of a sharded job it cannot see): its memory is spent
        # already; only the split of a GPU it shares with the server it starts is still to plan
        return None
    from verifiers_rl.plan.memory import fit_training

    user_share = flag_value(args.server_args or [], "gpu-memory-utilization")
    shared = serving.shared_gpu
    if shape is None:
        if shared and user_share is None:
            raise ConfigError(
                f"cannot plan one GPU for {args.output_dir!r}'s model: its config.json is not available here; set "
                "[inference.args] gpu_memory_utilization yourself (the fraction of the GPU vLLM may use)"
            )
        return None
    accelerate = read_accelerate_config(layout.accelerate_config) if layout.accelerate_config else None
    checkpointing = bool(args.activation_checkpointing)
    return fit_training(
        shape,
        machine.gpu_bytes,
        layout=training_layout(accelerate),
        ranks=len(gpus.trainer),
        use_lora=args.use_lora,
        lora_rank=args.lora_rank,
        micro_batch_size=args.micro_batch_size,
        max_seq_len=args.max_seq_len,
        micro_batch_tokens=args.micro_batch_tokens if "micro_batch_tokens" in user_set else None,
        activation_checkpointing=checkpointing if "activation_checkpointing" in user_set or checkpointing else None,
        shared_with_server=shared,
        gpu_memory_utilization=float(user_share) if user_share is not None and shared else None,
        sync_snapshot=serving.changed_only,
    )


def _user_set(args, named: frozenset[str] | None) -> frozenset[str]:
    """The fields the user set: as named, else those that differ from RLConfig's defaults."""
    if named is not None:
        return named
    from verifiers_rl.config.schema import load_schema

    def changed(name: str, default) -> bool:  # TrainingArguments turns some None defaults into False
        value = getattr(args, name, default)
        return value != default and not (default is None and value is False)

    return frozenset(k for k, v in load_schema().items() if changed(k, v["default"]))

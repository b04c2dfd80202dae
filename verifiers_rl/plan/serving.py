"""The serving plan: every decision about how the policy is served and synced, made once.

Inputs are the run's settings (some of them "auto"), the machine, and, for a server the trainer connects to,
what that server says it runs. The output is a frozen `ServingPlan`: `vf-rl --dry-run` prints it, `vf-rl` and
the trainer's runtime start the server from it, and the trainer syncs by it. This module is the only place an
"auto" is resolved (`tests/unit/test_plan.py` fails if another module compares a setting with "auto").

    engine        cpu | vllm         auto: vLLM where CUDA and vLLM are both present, else our CPU engine
    mode          spawn | connect    auto: the RL server already answering at host:port, else spawn one
    shared_gpu    bool               the server's GPU is one of the trainer's (NCCL cannot sync them)
    lora_sync     merged | adapter   auto: adapter for a LoRA policy on a shared GPU, merged otherwise
    sync_backend  gloo|nccl|adapter  auto: NCCL between separate GPUs, gloo through host memory otherwise
    server_pauses bool               the server pauses itself around a sync (our CPU engine: one request)
    threads       (server, trainer)  CPU threads when the CPU engine and an overlapping trainer share cores
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from verifiers_rl.config.choices import (
    CPU_ENGINES,
    ENGINES,
    LORA_SYNC,
    SERVER_MODES,
    SPARSE_NCCL,
    SYNC_BACKENDS,
    Engine,
    LoraSync,
    ServerMode,
    SyncBackend,
    Transport,
)
from verifiers_rl.errors import ConfigError
from verifiers_rl.plan.devices import visible_devices


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - a broken CUDA setup is no CUDA here
        return False


# ---------------------------------------------------------------------------------------------- the rules


def resolve_engine(requested: str, *, cuda: bool | None = None, vllm: bool | None = None) -> Engine:
    """'auto' -> vLLM when CUDA and vLLM are both present, else the CPU engine; 'cpu'/'vllm' stay as asked."""
    if requested not in ENGINES:
        raise ValueError(f"engine={requested!r}; allowed: {', '.join(ENGINES)}")
    if requested != Engine.AUTO:
        return Engine(requested)
    cuda = cuda_available() if cuda is None else cuda
    vllm = vllm_installed() if vllm is None else vllm
    return Engine.VLLM if cuda and vllm else Engine.CPU


def resolve_cpu_engine(requested: str, unsupported: str | None) -> str:
    """The CPU engine's loop: 'slots' unless the lean forward cannot run the model (`unsupported` says why)."""
    if requested not in CPU_ENGINES:
        raise ValueError(f"cpu engine {requested!r}; allowed: {', '.join(CPU_ENGINES)}")
    if requested == "auto":
        return "cb" if unsupported else "slots"
    if requested == "slots" and unsupported:
        raise ValueError(f"the slot engine does not support this model: {unsupported}")
    return requested


def resolve_mode(requested: str, discover: Callable[[], str]) -> ServerMode:
    """'auto' asks `discover()` ('connect' when an RL server answers where the trainer looks, else 'spawn')."""
    if requested not in SERVER_MODES:
        raise ValueError(f"server_mode={requested!r}; allowed: {', '.join(SERVER_MODES)}")
    return ServerMode(discover() if requested == ServerMode.AUTO else requested)


def shares_gpu(engine: str, server_uuids: Sequence[str] | None, trainer_uuids: Sequence[str]) -> bool:
    """Does a vLLM server run on one of the trainer's GPUs? (The CPU engine uses none.) GPUs are compared by UUID,
    the one name a GPU has in every process whatever its CUDA_VISIBLE_DEVICES; None: the server's are not known."""
    if engine != Engine.VLLM or server_uuids is None:
        return False
    return bool(set(server_uuids) & set(trainer_uuids))


@dataclass(frozen=True)
class ReportedGpus:
    """What a vLLM server's workers say about their GPUs (vf-vllm's `vf_device_uuids`, `session.reported_gpus`)."""

    uuids: tuple[str, ...]  # GPUs of the workers that answered (a worker without one answers "", left out)
    # workers that did not answer: vLLM passes a collective RPC to its first data-parallel engine only and drops
    # the others' results (v1/engine/core_client.py), so a later engine's GPUs are not seen; /get_world_size counts
    # every worker (TP x PP x DP)
    unseen: int = 0


def connected_server_uuids(
    reported: ReportedGpus | Sequence[str] | None, *, local: bool, cuda_count: int, trainer_uuids: Sequence[str]
) -> tuple[str, ...] | None:
    """The GPUs of a server the trainer connects to: what it reports (vf-vllm's workers answer `vf_device_uuids`;
    those of its first data-parallel engine only: `plan_serving`'s `server_unseen`); for a server that does not
    say, a local one on a machine whose only GPU the trainer sees without narrowing (CUDA_VISIBLE_DEVICES unset)
    can only be on that GPU; otherwise they are not known."""
    if isinstance(reported, ReportedGpus):
        return reported.uuids
    if reported is not None:
        return tuple(reported)
    if local and cuda_count == 1 and visible_devices() is None:
        return tuple(trainer_uuids)
    return None


def unseen_problem(
    args, unseen: int, seen: Sequence[str] | None, trainer_uuids: Sequence[str], *, local: bool
) -> str | None:
    """Why NCCL cannot be planned against a local server that reported the GPUs of only some of its workers, or
    None. The trainer's GPU may be one of the unseen ones, and NCCL cannot put two ranks on one GPU (the first sync
    would fail deep inside NCCL, or hang): with sync_backend "auto" that is refused; "nccl", set, is the user's
    word that the GPUs differ. A remote server cannot be on the trainer's GPU."""
    if not unseen or not local or not trainer_uuids or args.sync_backend != SyncBackend.AUTO:
        return None
    if set(trainer_uuids) & set(seen or ()):
        return None  # on a reported GPU: shares_gpu plans that
    told = len(seen or ())
    return (
        f"the inference server runs {told + unseen} workers but reported the GPUs of {told} (vLLM answers from its "
        f"first data-parallel engine only), so the trainer's GPU {', '.join(trainer_uuids)} may be one of the "
        "others', and NCCL cannot put two ranks on one GPU: give the trainer a GPU none of the server's engines "
        'uses and set sync_backend = "nccl" to say so, or let vf-rl start and place both'
    )


def resolve_lora_sync(requested: str, *, use_lora: bool, modules_to_save, shared_gpu: bool) -> LoraSync:
    """'merged' for full fine-tuning; 'auto': adapter for a LoRA policy on a shared GPU (no NCCL there, and 1-2%
    of the bytes) unless modules are trained in full beside the adapter, merged otherwise."""
    if requested not in LORA_SYNC:
        raise ValueError(f"lora_sync={requested!r}; allowed: {', '.join(LORA_SYNC)}")
    if not use_lora:
        return LoraSync.MERGED
    if requested == LoraSync.AUTO:
        return LoraSync.ADAPTER if shared_gpu and not modules_to_save else LoraSync.MERGED
    return LoraSync(requested)


def resolve_sync_backend(
    requested: str, engine: Engine, *, shared_gpu: bool = False, lora_sync: LoraSync = LoraSync.MERGED
) -> Transport:
    """How the weights travel: 'adapter' (LoRA A/B over gloo into the served adapter), 'gloo' (host memory: the
    CPU engine, or a server on the trainer's own GPU) or 'nccl' (GPU to GPU, vLLM's own engine)."""
    if requested not in SYNC_BACKENDS:
        raise ValueError(f"sync_backend={requested!r}; allowed: {', '.join(SYNC_BACKENDS)}")
    if engine not in (Engine.CPU, Engine.VLLM):
        raise ValueError(f"engine={engine!r} is not resolved; call resolve_engine first")
    if engine == Engine.CPU and requested == SyncBackend.NCCL:
        raise ValueError("sync_backend='nccl' needs a vLLM server; the CPU engine syncs over gloo")
    if shared_gpu and requested == SyncBackend.NCCL:
        raise ValueError("sync_backend='nccl' cannot sync a server on the trainer's own GPU; use gloo")
    if lora_sync == LoraSync.ADAPTER:
        return Transport.ADAPTER
    if engine == Engine.CPU or shared_gpu:
        return Transport.GLOO
    return Transport.NCCL if requested == SyncBackend.AUTO else Transport(requested)


def cpu_thread_split(
    engine: str, *, local: bool, max_async_level: int, cuda: bool, cores: int | None = None
) -> tuple[int, int] | None:
    """(server threads, trainer threads) when the CPU engine and an overlapping trainer share this machine's cores.

    With max_async_level >= 1 generation and training run at the same time; each process defaulting to every core
    oversubscribes them (1+1 threads beat 2+2 on 2 cores in benchmarks/bench_async.py). None when they do not share
    cores or do not overlap (each phase then gets every core), or when OMP_NUM_THREADS is set (the user's choice
    wins).
    """
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    cores = cores or os.cpu_count() or 1
    if cores < 2 or max_async_level < 1 or engine == Engine.VLLM or not local or cuda:
        return None
    server = cores // 2
    return server, cores - server


# ---------------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class ServingPlan:
    engine: Engine  # resolved: CPU or VLLM
    mode: ServerMode  # resolved: SPAWN or CONNECT
    shared_gpu: bool
    lora_sync: LoraSync  # resolved: MERGED or ADAPTER (full fine-tuning: MERGED)
    sync_backend: Transport
    server_pauses: bool  # the server pauses, finishes and resumes by itself around a sync
    server_gpus: tuple[int, ...] | None = None  # GPUs of a server we start, as indices of our visible GPUs
    server_uuids: tuple[str, ...] | None = None  # the same GPUs by UUID: one name in every process
    data_parallel: int = 1
    threads: tuple[int, int] | None = None  # (server, trainer) CPU threads
    changed_only: bool = False  # sync only the changed elements (sync/delta.py): RLConfig.sync_changed_only

    def __post_init__(self):
        # a plan read back from JSON (`from_json`) or built from strings holds the same members as one planned here
        for name, choice in (("engine", Engine), ("mode", ServerMode), ("lora_sync", LoraSync)):
            object.__setattr__(self, name, choice(getattr(self, name)))
        object.__setattr__(self, "sync_backend", Transport(self.sync_backend))
        if self.engine == Engine.AUTO or self.mode == ServerMode.AUTO or self.lora_sync == LoraSync.AUTO:
            raise ValueError(f"a ServingPlan holds resolved choices, not 'auto': {self}")

    @property
    def weights(self) -> str:
        """What the trainer sends each sync: 'adapter' (LoRA A/B only) or 'merged' (every weight, LoRA merged)."""
        return LoraSync.ADAPTER if self.lora_sync == LoraSync.ADAPTER else LoraSync.MERGED

    @property
    def server_weight_backend(self) -> str | None:
        """vLLM's --weight-transfer-backend for a server we start: gloo for our gloo group (merged or adapter),
        vLLM's own NCCL otherwise (its `sparse_nccl` for changes only); None for the CPU engine (gloo only)."""
        if self.engine != Engine.VLLM:
            return None
        if self.sync_backend == Transport.NCCL:
            return SPARSE_NCCL if self.changed_only else Transport.NCCL
        return Transport.GLOO

    def server_env(self) -> dict[str, str] | None:
        """The server's share of the CPU threads, as environment for its process."""
        return {"OMP_NUM_THREADS": str(self.threads[0])} if self.threads else None

    def to_json(self) -> str:
        """For a trainer process that another process planned for (vf-rl's `accelerate launch` ranks)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ServingPlan:
        fields = json.loads(text)
        for key in ("server_gpus", "server_uuids", "threads"):
            if fields.get(key) is not None:
                fields[key] = tuple(fields[key])
        return cls(**fields)

    def describe(self) -> list[str]:
        if self.engine == Engine.CPU:  # it holds its weights in host memory whatever GPUs its process can see
            where = " on the CPU"
        elif self.shared_gpu:
            where = " on a GPU it shares with the trainer"
        elif self.server_gpus:
            where = f" on GPU {','.join(map(str, self.server_gpus))}"
        else:
            where = ""
        lines = [f"engine {self.engine}, {self.mode}ed{where}"]
        how = {"nccl": "NCCL (GPU to GPU)", "gloo": "gloo (host memory)", "adapter": "gloo, LoRA A/B only"}
        lines.append(f"weight sync: {self.weights} weights over {how[self.sync_backend]}")
        lines.append("pauses: " + ("the server, inside one sync request" if self.server_pauses else "the trainer"))
        if self.threads:
            lines.append(f"CPU threads: server {self.threads[0]}, trainer {self.threads[1]}")
        return lines


def plan_serving(
    args,
    *,
    mode: str,
    engine: str,
    cuda_count: int,
    server_uuids: Sequence[str] | None = None,
    trainer_uuids: Sequence[str] = (),
    server_gpus: Sequence[int] | None = None,
    data_parallel: int = 1,
    post_processed: str | None = None,
    server_unseen: int = 0,
) -> ServingPlan:
    """The plan for `args` (an RLConfig) once the mode and the engine are known (`resolve_mode`, and
    `resolve_engine` or, for a server the trainer connects to, what it says it runs). GPUs by UUID: the server's
    (None: not known) and this trainer's; `server_gpus` are the server's as indices of our visible GPUs, for its
    CUDA_VISIBLE_DEVICES. `post_processed`: the model's config entry for which vLLM post-processes the weights it
    loads (`shape.ModelShape.post_processed`). `server_unseen`: workers of a connected server whose GPUs it did not
    report (`ReportedGpus.unseen`). The memory split of a shared GPU is the run plan's (`run.plan_run`)."""
    from verifiers_rl.config.net import is_local

    local = is_local(args.vllm_server_host)
    shared = shares_gpu(engine, server_uuids, trainer_uuids)
    lora_sync = resolve_lora_sync(
        args.lora_sync, use_lora=args.use_lora, modules_to_save=args.lora_modules_to_save, shared_gpu=shared
    )
    backend = resolve_sync_backend(args.sync_backend, engine, shared_gpu=shared, lora_sync=lora_sync)
    if backend == Transport.NCCL and engine == Engine.VLLM:
        problem = unseen_problem(args, server_unseen, server_uuids, trainer_uuids, local=local)
        if problem:
            raise ConfigError(problem)
    threads = cpu_thread_split(engine, local=local, max_async_level=args.max_async_level, cuda=cuda_count > 0)
    changed_only = bool(getattr(args, "sync_changed_only", False))
    if changed_only:
        check_changed_only(
            engine, backend, use_lora=args.use_lora, cuda=cuda_count > 0 or not local, post_processed=post_processed
        )
    return ServingPlan(
        engine=engine,
        mode=mode,
        shared_gpu=shared,
        lora_sync=lora_sync,
        sync_backend=backend,
        server_pauses=engine == Engine.CPU and backend == Transport.GLOO,  # our engine folds the sync into one request
        server_gpus=tuple(server_gpus) if server_gpus is not None else None,
        server_uuids=tuple(server_uuids) if server_uuids is not None and engine == Engine.VLLM else None,
        data_parallel=data_parallel,
        threads=threads,
        changed_only=changed_only,
    )


def check_changed_only(
    engine: str, backend: str, *, use_lora: bool, cuda: bool = True, post_processed: str | None = None
) -> None:
    """sync_changed_only (sync/delta.py) is for full fine-tuning over gloo or NCCL: into our CPU engine, or into
    vLLM on a GPU, which writes the changes into its live parameters (`delta.Receiving.through`). vLLM's CPU build
    keeps its linear layers only repacked, and a LoRA sync is small already. `cuda`: vLLM may run on a GPU (a local
    one is seen here; a remote server's is not, and its workers refuse in one line if they cannot).

    `post_processed` (a MoE or quantized model, `shape.post_processed`): vLLM may reorder or repack those weights
    for its kernels after loading (FlashInfer's CUTLASS MoE path, its default off Hopper); changes written through
    the loader's mapping then land in the loader's layout over the kernel's, and `delta.not_landed` compares
    through the same mapping, so it passes while the weights are wrong. No check against the runtime layout
    exists, so such a model is refused into vLLM (our CPU engine holds transformers' layout, the trainer's)."""
    if use_lora:
        raise ValueError("sync_changed_only is for full fine-tuning; a LoRA policy's sync is small already")
    if backend not in (Transport.GLOO, Transport.NCCL):
        raise ValueError(f"sync_changed_only needs sync_backend gloo or nccl (this run: {backend!r})")
    if engine == Engine.VLLM and not cuda:
        raise ValueError(
            "sync_changed_only into vLLM needs vLLM on a GPU: its CPU build keeps linear layers only repacked for "
            'its kernels, so changes cannot be written in place; use server_engine = "cpu" on CPU'
        )
    if engine == Engine.VLLM and post_processed:
        raise ConfigError(
            f"sync_changed_only cannot sync this model into vLLM (its config has {post_processed}): vLLM may "
            "reorder or repack those weights for its kernels after loading, and changes written in the loader's "
            "layout would land in the wrong places unseen; set sync_changed_only = false (a full sync)"
        )


def placement_problem(plan: ServingPlan, trainer_uuid: str | None) -> str | None:
    """Why this trainer process cannot sync by `plan`, or None. NCCL cannot put the trainer and a server worker
    on one GPU: when the trainer's own GPU (by UUID, whatever each process's CUDA_VISIBLE_DEVICES) is one of the
    server's while the plan syncs over NCCL, the first sync would fail deep inside NCCL."""
    if plan.sync_backend != Transport.NCCL or not plan.server_uuids or trainer_uuid is None:
        return None
    if trainer_uuid not in plan.server_uuids:
        return None
    return (
        f"the trainer runs on GPU {trainer_uuid}, which the inference server uses too, but weights would travel "
        "over NCCL, which cannot put two ranks on one GPU: give the trainer its own GPU (CUDA_VISIBLE_DEVICES, "
        '[trainer] gpus / server_gpus), or share it on purpose with sync_backend = "gloo"'
    )

"""The serving plan: one object resolves every "auto", and vf-rl's plan, the runtime and the launcher read it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from verifiers_rl.plan.devices import assign_gpus
from verifiers_rl.plan.run import Machine, plan_run
from verifiers_rl.plan.serving import (
    ServingPlan,
    check_changed_only,
    cpu_thread_split,
    plan_serving,
    resolve_engine,
    resolve_lora_sync,
    resolve_mode,
)
from verifiers_rl.serving.launcher import server_of

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "verifiers_rl"
PLAN = PACKAGE / "plan" / "serving.py"


def _cfg(**kw):
    from verifiers_rl.trainer import RLConfig

    return RLConfig(output_dir="/tmp/x", use_cpu=True, **kw)


def _compares_with_auto(node: ast.AST) -> bool:
    if not isinstance(node, ast.Compare):
        return False
    operands = [node.left, *node.comparators]
    for op in operands:
        if isinstance(op, ast.Constant) and op.value == "auto":
            return True
        if isinstance(op, (ast.Tuple, ast.List, ast.Set)):
            if any(isinstance(e, ast.Constant) and e.value == "auto" for e in op.elts):
                return True
    return False


def test_only_the_plan_resolves_auto():
    """A setting compared with "auto" anywhere but plan/serving.py is a rule written twice."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path == PLAN:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if _compares_with_auto(node):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"'auto' resolved outside the serving plan: {offenders}"


def test_the_auto_check_catches_a_comparison():
    assert _compares_with_auto(ast.parse("x == 'auto'").body[0].value)
    assert _compares_with_auto(ast.parse("x in ('auto', 'cpu')").body[0].value)
    assert not _compares_with_auto(ast.parse("x == 'cpu'").body[0].value)


def _import_graph() -> dict[str, set[str]]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):  # imports inside functions count too
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for name in names:
                target = resolve(name) if name.startswith("verifiers_rl") else None
                if target and target != module:
                    graph[module].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_in_a_cycle():
    assert not _cycles(_import_graph())


def _package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else "verifiers_rl"  # a top-level module (errors, models) is the root


def test_no_stage_package_imports_in_a_cycle():
    """The stage packages (config, plan, sync, serving, inference, rollouts, batch, loss, export, trainer) form a
    layering: a package never needs, through any chain of imports, a package that needs it."""
    packages: dict[str, set[str]] = {}
    for module, targets in _import_graph().items():
        packages.setdefault(_package_of(module), set()).update(
            p for p in map(_package_of, targets) if p != _package_of(module)
        )
    for targets in list(packages.values()):
        for p in targets:
            packages.setdefault(p, set())
    assert not _cycles(packages)
    assert "trainer" not in packages["rollouts"] and "trainer" not in packages["export"]


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_functions_stay_short():
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 80:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, f"functions over 80 lines (split them): {long}"


# ---------------------------------------------------------------------------------------------- decisions


def test_engine_mode_and_lora_sync_rules():
    assert resolve_engine("auto", cuda=True, vllm=True) == "vllm"
    assert resolve_engine("auto", cuda=True, vllm=False) == "cpu"
    assert resolve_engine("cpu", cuda=True, vllm=True) == "cpu"
    assert resolve_mode("auto", lambda: "connect") == "connect"
    assert resolve_mode("spawn", lambda: pytest.fail("a set mode is not discovered")) == "spawn"
    assert resolve_lora_sync("auto", use_lora=True, modules_to_save=None, shared_gpu=True) == "adapter"
    assert resolve_lora_sync("auto", use_lora=True, modules_to_save=["lm_head"], shared_gpu=True) == "merged"
    assert resolve_lora_sync("adapter", use_lora=False, modules_to_save=None, shared_gpu=True) == "merged"


def test_vf_rl_and_the_runtime_make_the_same_plan_for_a_shared_gpu_on_two_gpus():
    """[inference] gpus = 0 on a 2-GPU host: the device split says shared; the plan the trainer follows is the
    same object, so its sync backend and LoRA sync agree with the server vf-rl starts."""
    from verifiers_rl.plan.run import Layout

    assert assign_gpus(2, 0, 1).shared
    machine = Machine(2, 80 << 30, ("cuda:0", "cuda:1"), vllm=True, real=False)
    # the user's share of the GPU for vLLM: the plan keeps it (the model's shape is not needed then)
    args = _cfg(server_engine="vllm", server_args=["--gpu-memory-utilization", "0.5"])
    run = plan_run(args, "Qwen/Qwen3-0.6B", machine, Layout(inference_gpus=0, trainer_gpus=1))
    plan = run.serving
    assert run.gpus.shared and plan.shared_gpu
    assert (plan.lora_sync, plan.sync_backend, plan.server_weight_backend) == ("adapter", "adapter", "gloo")
    assert server_of(run).command().count("--gpu-memory-utilization") == 1
    again = plan_serving(_cfg(), mode="connect", engine="vllm", cuda_count=2, trainer_uuids=["cuda:1"])
    assert (again.sync_backend, again.lora_sync) == ("nccl", "merged")  # a server elsewhere: what it reports decides
    assert ServingPlan.from_json(plan.to_json()) == plan


def test_full_fine_tuning_on_a_shared_gpu_starts_the_server_with_the_trainers_backend():
    args = _cfg(server_engine="vllm", use_lora=False)
    plan = plan_serving(args, mode="spawn", engine="vllm", cuda_count=1, server_uuids=["G0"], trainer_uuids=["G0"])
    assert plan.shared_gpu and plan.sync_backend == "gloo" and plan.server_weight_backend == "gloo"
    separate = plan_serving(
        args, mode="spawn", engine="vllm", cuda_count=2, server_uuids=["G0"], trainer_uuids=["G1"], server_gpus=[0]
    )
    assert not separate.shared_gpu and separate.sync_backend == "nccl" and separate.server_weight_backend == "nccl"


def test_cpu_engine_plan():
    plan = plan_serving(_cfg(server_engine="cpu", max_async_level=0), mode="spawn", engine="cpu", cuda_count=0)
    assert (plan.sync_backend, plan.server_pauses, plan.weights) == ("gloo", True, "merged")
    adapter = plan_serving(_cfg(server_engine="cpu", lora_sync="adapter"), mode="spawn", engine="cpu", cuda_count=0)
    assert (adapter.sync_backend, adapter.server_pauses, adapter.weights) == ("adapter", False, "adapter")
    with pytest.raises(ValueError, match="needs a vLLM server"):
        plan_serving(_cfg(server_engine="cpu", sync_backend="nccl"), mode="spawn", engine="cpu", cuda_count=0)


def test_changed_only_sync_is_for_full_finetuning_over_gloo_or_nccl():
    ok = plan_serving(
        _cfg(server_engine="cpu", use_lora=False, sync_changed_only=True), mode="spawn", engine="cpu", cuda_count=0
    )
    assert (ok.sync_backend, ok.server_pauses) == ("gloo", True)
    with pytest.raises(ValueError, match="sync_changed_only is for full fine-tuning"):
        plan_serving(_cfg(server_engine="cpu", sync_changed_only=True), mode="spawn", engine="cpu", cuda_count=0)
    assert ok.server_weight_backend is None
    nccl = plan_serving(_cfg(use_lora=False, sync_changed_only=True), mode="spawn", engine="vllm", cuda_count=2)
    assert (nccl.sync_backend, nccl.changed_only, nccl.server_weight_backend) == ("nccl", True, "sparse_nccl")
    dense = plan_serving(_cfg(use_lora=False), mode="spawn", engine="vllm", cuda_count=2)
    assert (dense.changed_only, dense.server_weight_backend) == (False, "nccl")
    shared = plan_serving(
        _cfg(use_lora=False, sync_changed_only=True, sync_backend="gloo"), mode="spawn", engine="vllm", cuda_count=1
    )
    assert (shared.sync_backend, shared.server_weight_backend) == ("gloo", "gloo")
    with pytest.raises(ValueError, match="sync_changed_only into vLLM needs vLLM on a GPU"):
        plan_serving(_cfg(use_lora=False, sync_changed_only=True), mode="spawn", engine="vllm", cuda_count=0)
    with pytest.raises(ValueError, match="sync_changed_only needs sync_backend gloo or nccl"):
        check_changed_only("vllm", "adapter", use_lora=False)


def test_cpu_thread_split(monkeypatch):
    """The CPU engine and an overlapping trainer split the cores instead of both taking all of them."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def split(engine="cpu", local=True, level=1, cores=2):
        return cpu_thread_split(engine, local=local, max_async_level=level, cuda=False, cores=cores)

    assert split() == (1, 1)
    assert split(level=2, cores=7) == (3, 4)
    assert split(level=0, cores=8) is None  # no overlap: each phase gets every core
    assert split(cores=1) is None
    assert split(local=False, cores=8) is None  # another machine
    assert split(engine="vllm", cores=8) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert split(cores=8) is None  # the user's setting wins
    monkeypatch.delenv("OMP_NUM_THREADS")
    plan = plan_serving(_cfg(server_engine="cpu", max_async_level=1), mode="spawn", engine="cpu", cuda_count=0)
    assert plan.threads == cpu_thread_split("cpu", local=True, max_async_level=1, cuda=False)
    assert plan.server_env() == ({"OMP_NUM_THREADS": str(plan.threads[0])} if plan.threads else None)


def test_openmp_spin_is_bounded_for_what_the_commands_start(monkeypatch):
    """libgomp's idle workers spin 300k iterations by default, which stalls torch when anything else runs on the
    cores (verifiers_rl/inference/cpu/openmp.py has the measurements); a user's own spin or wait policy wins."""
    import subprocess
    import sys

    from verifiers_rl.inference.cpu.openmp import SPIN_COUNT, bound_openmp_spin
    from verifiers_rl.scripts.common import run_cli

    assert bound_openmp_spin(env := {}) and env == {"GOMP_SPINCOUNT": SPIN_COUNT}
    assert not bound_openmp_spin(env := {"GOMP_SPINCOUNT": "0"}) and env == {"GOMP_SPINCOUNT": "0"}
    assert not bound_openmp_spin(env := {"OMP_WAIT_POLICY": "PASSIVE"}) and "GOMP_SPINCOUNT" not in env
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):  # set first, so that the teardown removes what run_cli sets
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    seen = []

    def body() -> int:  # a command's child process (the server, the SFT run) inherits the setting
        code = "import os; print(os.environ.get('GOMP_SPINCOUNT'))"
        seen.append(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip())
        return 0

    assert run_cli("vf-test", body) == 0 and seen == [SPIN_COUNT]

"""The GPU layouts `vf-rl` plans, checked as the processes will see them (no GPU here: the plans are built for
1, 2 and 8 GPUs and read back). For every layout the server's weight-transfer backend is the trainer's, every
process gets its own CUDA_VISIBLE_DEVICES, no two NCCL ranks share a device, adapters are served where adapters
are synced, and the trainer runs by vf-rl's serving plan."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from verifiers_rl.config.run_file import RunFile, build_rl_config
from verifiers_rl.plan.devices import child_visible_devices
from verifiers_rl.plan.run import PLAN_ENV, probe_machine
from verifiers_rl.plan.serving import ServingPlan, plan_serving
from verifiers_rl.scripts.rl_plan import build_plan, trainer_env

POLICIES = {
    "full": {"use_lora": False},
    "lora-merged": {"lora_sync": "merged"},
    "lora-adapter": {"lora_sync": "adapter"},
    "lora-auto": {},  # adapter on a shared GPU, merged otherwise
}


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def _layout(tmp_path, gpus: int, trainers: int, policy: str):
    inference = gpus - trainers if gpus - trainers >= 1 else 0  # 0: the server shares the trainer's first GPU
    args = "\n".join(f"{k} = {json.dumps(v)}" for k, v in POLICIES[policy].items())
    path = tmp_path / "cfg.toml"
    path.write_text(
        textwrap.dedent(
            f"""
            model = "Qwen/Qwen3-0.6B"
            output_dir = "{tmp_path / "out"}"
            [env]
            id = "reverse-text"
            [inference]
            gpus = {inference}
            [trainer]
            gpus = {trainers}
            """
        )
        + f"[trainer.args]\nbatch_size = 32\nrollouts_per_example = 4\nmicro_batch_size = 4\n{args}\n"
    )
    return build_plan(RunFile.read(path), probe_machine(gpus, 80), dry_run=True)


LAYOUTS = [
    (gpus, trainers, policy) for gpus in (1, 2, 8) for trainers in (1, 2) for policy in POLICIES if trainers <= gpus
]


@pytest.mark.parametrize(("gpus", "trainers", "policy"), LAYOUTS, ids=lambda v: str(v))
def test_planned_processes_agree(tmp_path, monkeypatch, gpus, trainers, policy):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    plan = _layout(tmp_path, gpus, trainers, policy)
    serving, server = plan.serving, plan.server.command()
    env = trainer_env(plan, token="t")

    # one backend on both sides: the server's receiver is the trainer's sender
    trainer_backend = serving.server_weight_backend
    assert _flag(server, "--weight-transfer-backend") == trainer_backend
    assert serving.sync_backend in (trainer_backend, "adapter")

    # every process narrowed to its own GPUs; the trainer never runs in vf-rl's process (which sees them all)
    server_devs = set(plan.gpus.inference)
    trainer_devs = {int(d) for d in env["CUDA_VISIBLE_DEVICES"].split(",")}
    assert plan.trainer_cmd and trainer_devs == set(plan.gpus.trainer) and len(trainer_devs) == trainers
    assert plan.server.environment()["CUDA_VISIBLE_DEVICES"] == child_visible_devices(plan.gpus.inference)
    if trainers > 1:
        assert _flag(plan.trainer_cmd, "--num_processes") == str(trainers)
    else:
        assert "accelerate.commands.launch" not in plan.trainer_cmd

    # NCCL: no trainer rank on a device of the server's; sharing a GPU means gloo
    if trainer_backend == "nccl":
        assert not server_devs & trainer_devs
    assert serving.shared_gpu == bool(server_devs & trainer_devs)
    if serving.shared_gpu:
        assert trainer_backend == "gloo" and _flag(server, "--gpu-memory-utilization") is not None

    # adapters served exactly where adapters are synced
    adapter = serving.lora_sync == "adapter"
    assert adapter == (policy == "lora-adapter" or (serving.shared_gpu and policy == "lora-auto"))
    assert ("--enable-lora" in server) == adapter
    assert (_flag(server, "--lora-modules") or "").startswith("policy=") == adapter

    # the trainer follows vf-rl's plan, handed over once in its environment: the serving plan and its RLConfig's
    # arguments, which carry the values the memory fit chose
    handed = json.loads(env[PLAN_ENV])
    assert ServingPlan.from_json(json.dumps(handed["serving"])) == serving
    args = build_rl_config(handed["trainer"]["args"], cuda=False, quiet=True)
    assert all(getattr(args, k) == v for k, v in plan.run.measures.items())
    mine = tuple(f"cuda:{i}" for i in plan.gpus.trainer)
    again = plan_serving(
        args, mode="connect", engine="vllm", cuda_count=trainers, server_uuids=serving.server_uuids, trainer_uuids=mine
    )
    assert again.lora_sync == serving.lora_sync
    assert again.sync_backend == serving.sync_backend and again.shared_gpu == serving.shared_gpu


def test_plan_indices_count_the_visible_gpus(monkeypatch):
    """Under CUDA_VISIBLE_DEVICES=4,5,6 the plan's GPU 1 is physical GPU 5, for the server and the trainer alike
    (a child's CUDA_VISIBLE_DEVICES replaces its parent's: passing "1" on would pick physical GPU 1)."""
    from verifiers_rl.errors import ConfigError
    from verifiers_rl.serving.launcher import InferenceServer

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert child_visible_devices([1, 2]) == "5,6"
    server = InferenceServer("m", engine="vllm", gpus=[1], output_dir=os.devnull)
    assert server.environment()["CUDA_VISIBLE_DEVICES"] == "5"
    with pytest.raises(ConfigError, match="GPU index 3 is not among"):
        child_visible_devices([3])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa,GPU-bbbb")  # UUIDs pass through as they are
    assert child_visible_devices([1]) == "GPU-bbbb"


class _Props:
    def __init__(self, uuid: str):
        self.uuid, self.total_memory = uuid, 80 << 30


def _fake_gpus(monkeypatch, uuids: list[str], current: int = 0):
    """torch.cuda as a process with these visible GPUs sees it (no GPU here: the device is all that is faked)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(uuids))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: _Props(uuids[int(i)]))


def test_a_trainer_on_the_servers_gpu_is_refused_before_nccl_hangs(monkeypatch, tmp_path):
    """vf-rl planned NCCL between GPU 0 (server) and GPU 1 (trainer); a trainer process that nonetheless sees the
    server's GPU as its own (CUDA_VISIBLE_DEVICES not narrowed) stops with one line, by UUID."""
    from verifiers_rl.errors import ServerError
    from verifiers_rl.serving.session import ServerSession

    plan = plan_serving(
        _args(), mode="spawn", engine="vllm", cuda_count=2, server_uuids=["GPU-a"], trainer_uuids=["GPU-b"]
    )
    assert plan.sync_backend == "nccl"
    session = ServerSession(_args(), None)
    session.plan = plan
    _fake_gpus(monkeypatch, ["GPU-b"])  # narrowed to its own GPU: fine
    session._check_placement()
    _fake_gpus(monkeypatch, ["GPU-a", "GPU-b"])  # every GPU visible: cuda:0 is the server's
    with pytest.raises(ServerError, match="the trainer runs on GPU GPU-a, which the inference server uses too"):
        session._check_placement()


def test_one_process_never_spreads_over_several_gpus():
    """Trainer's DataParallel over every visible GPU would take the server's GPU and count each step's batch
    once per GPU: an RLConfig process trains on one GPU (several GPUs are several processes)."""
    args = _args()
    args._n_gpu = 2  # what TrainingArguments computes for one process that sees two GPUs
    assert args.n_gpu == 1 and args.train_batch_size == 1


def test_connected_servers_gpus(monkeypatch):
    from verifiers_rl.plan.serving import connected_server_uuids

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert connected_server_uuids(["G1"], local=True, cuda_count=1, trainer_uuids=["G0"]) == ("G1",)  # it said
    assert connected_server_uuids(None, local=True, cuda_count=1, trainer_uuids=["G0"]) == ("G0",)  # the only GPU
    assert connected_server_uuids(None, local=True, cuda_count=2, trainer_uuids=["G0"]) is None
    assert connected_server_uuids(None, local=False, cuda_count=1, trainer_uuids=["G0"]) is None
    # upstream's two-shell flow: CUDA_VISIBLE_DEVICES=1 for the trainer, the server on GPU 0: not the same GPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert connected_server_uuids(None, local=True, cuda_count=1, trainer_uuids=["G1"]) is None
    plan = plan_serving(_args(), mode="connect", engine="vllm", cuda_count=1, server_uuids=None, trainer_uuids=["G1"])
    assert not plan.shared_gpu and plan.sync_backend == "nccl" and plan.lora_sync == "merged"


def _args(**kw):
    from verifiers_rl.trainer import RLConfig

    return RLConfig(output_dir="/tmp/x", use_cpu=True, server_engine="vllm", **kw)


def test_vf_rl_starts_vllm_with_a_zero_adapter_of_the_trainers_layout(tmp_path, tiny_model_dir):
    """vf-rl starts vLLM before the trainer exists: the adapter it registers has the trainer's modules, ranks and
    scaling config with zero weights, so it serves the base model (= the step-0 policy) until the first sync."""
    from types import SimpleNamespace

    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file

    from verifiers_rl.config.lora import lora_ranks
    from verifiers_rl.sync.policy_weights import adapter_weights
    from verifiers_rl.sync.transport.adapter import write_zero_adapter
    from verifiers_rl.tiny import build_tiny_model

    config = LoraConfig(r=8, lora_alpha=16, rank_pattern={"v_proj": 4}, target_modules=["q_proj", "v_proj", "up_proj"])
    args = SimpleNamespace(lora_config=config)
    write_zero_adapter(tiny_model_dir, args, tmp_path / "adapter")
    trainer = adapter_weights(get_peft_model(build_tiny_model(seed=0)[0], config))  # what the trainer will sync
    files = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert {n: tuple(t.shape) for n, t in files.items()} == {n: tuple(t.shape) for n, t in trainer.tensors}
    assert all(not t.any() for t in files.values()) and lora_ranks(args) == 8
    base = build_tiny_model(seed=0)[0].eval()
    served = PeftModel.from_pretrained(build_tiny_model(seed=0)[0], str(tmp_path / "adapter")).eval()
    ids = torch.tensor([[1, 5, 9, 42, 7]])
    assert torch.equal(served(ids).logits, base(ids).logits)


def test_a_run_follows_the_launchers_mixed_precision(monkeypatch):
    """`accelerate launch` with upstream's zero3.yaml (mixed_precision: bf16) exports ACCELERATE_MIXED_PRECISION;
    the run trains in it, so DeepSpeed's config check (bf16.enabled vs the trainer's bf16) passes instead of
    refusing the first step."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    args = _args()
    assert args.bf16 and not args.fp16
    ds = HfTrainerDeepSpeedConfig({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}})
    ds.trainer_config_process(args)  # raises "ds bf16.enabled=True vs hf bf16|bf16_full_eval=False" on a mismatch
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    assert not _args().bf16
    assert _args(fp16=False, bf16=False).bf16 is False


def test_multi_node_plan_prints_every_machine(tmp_path):
    """`vf-rl --dry-run --nodes 2 --gpus 8`: node 0 serves for remote trainers (token-guarded control routes), node 1
    trains as one accelerate world rendezvousing at itself and connects to node 0."""
    from verifiers_rl.scripts.rl_nodes import node_commands as plan_nodes

    def node_commands(cfg, path, *rest):  # the config as vf-rl hands it over: read once, its aliases folded
        run = RunFile.parse(cfg)
        run._path = path
        return plan_nodes(run, *rest)

    cfg = {"model": "Qwen/Qwen3-0.6B", "env": {"id": "reverse-text"}, "inference": {"gpus": 8},
           "trainer": {"accelerate_config": "configs/accelerate/zero3.yaml"}}  # fmt: skip
    (server_node, server), (trainer_node, trainer) = node_commands(cfg, str(tmp_path / "c.toml"), [], 2, 8)
    assert "node 0" in server_node and "--allow-remote-control" in server and "--data-parallel-size 8" in server
    assert server.startswith("CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 vf-vllm")
    assert "--num_machines 1" in trainer and "--machine_rank 0" in trainer and "--num_processes 8" in trainer
    assert "--trainer.args.vllm_server_host $NODE0" in trainer and "--trainer.args.server_mode connect" in trainer
    assert "--config_file configs/accelerate/zero3.yaml" in trainer and "VF_CONTROL_TOKEN" in trainer
    cfg["inference"]["args"] = {"enforce_eager": True, "enable_prefix_caching": False, "gpu_memory_utilization": 0.8}
    (_, server), _ = node_commands(cfg, str(tmp_path / "c.toml"), [], 2, 8)
    assert "--enforce-eager" in server and "--gpu-memory-utilization 0.8" in server
    assert "prefix-caching" not in server  # false drops the flag, as the one-machine launch does (not "=False")
    three = node_commands(cfg, str(tmp_path / "c.toml"), [], 3, 8)
    assert [line.split("--machine_rank ")[1].split()[0] for _, line in three[1:]] == ["0", "1"]


def test_dry_run_refuses_a_trainer_rank_that_cannot_fit():
    from verifiers_rl.errors import ConfigError
    from verifiers_rl.plan.memory import fit_training, rank_parts, shape_of
    from verifiers_rl.plan.ranks import training_layout

    shape = shape_of("Qwen/Qwen3-8B")
    kw = {"use_lora": False, "lora_rank": 8, "micro_batch_tokens": 2048, "max_seq_len": 2048}
    deepspeed = {"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 3}}
    layout = training_layout(deepspeed)
    ddp = rank_parts(shape, layout="ddp", ranks=8, activation_checkpointing=True, **kw)
    zero3 = rank_parts(shape, layout=layout, ranks=8, activation_checkpointing=True, **kw)
    assert layout == "zero3" and zero3["parameters"] * 8 == ddp["parameters"] and zero3["optimizer"] < ddp["optimizer"]
    # both settings the planner could change are set, so it fits as configured or refuses
    plan = dict(ranks=8, micro_batch_size=1, activation_checkpointing=True, shared_with_server=False, **kw)
    # 8B full fine-tuning replicated: weights, gradients and AdamW exceed 40 GiB; the refusal names sharding
    with pytest.raises(ConfigError, match="one trainer rank needs ~.*shard the model"):
        fit_training(shape, 40 << 30, layout="ddp", **plan)
    fits = fit_training(shape, 40 << 30, layout=layout, **plan)
    assert fits.measures == {} and fits.parts == zero3 and zero3["total"] <= 40 << 30
    assert training_layout({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}}) == "fsdp2"
    with pytest.raises(ConfigError, match="FSDP version 1 is not supported"):
        training_layout({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 1}})


def test_fsdp2_is_requested_by_the_launcher_or_by_trainingarguments(monkeypatch):
    """Both routes docs/scaling.md names: accelerate's exported FSDP settings, and `fsdp` + `fsdp_config` version 2."""
    from types import SimpleNamespace

    from verifiers_rl.config.sharding import fsdp2_requested

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    monkeypatch.delenv("FSDP_VERSION", raising=False)
    args = SimpleNamespace(fsdp=[], fsdp_config={})
    assert not fsdp2_requested(args)
    assert fsdp2_requested(SimpleNamespace(fsdp=["full_shard"], fsdp_config={"version": 2}))
    assert not fsdp2_requested(SimpleNamespace(fsdp=["full_shard"], fsdp_config={"version": 1}))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert fsdp2_requested(args)
    monkeypatch.setenv("FSDP_VERSION", "1")
    assert not fsdp2_requested(args)


def test_zero3_on_cpu_sizes_the_buckets_its_config_leaves_out():
    """accelerate's config from zero3.yaml names no bucket sizes (DeepSpeed's default reduce bucket, 5e8 elements,
    holds a small model's whole gradient); on a CPU run they become "auto", which Trainer fills from the model.
    Sizes the config names, other stages and GPU runs are left alone."""
    from types import SimpleNamespace

    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    from verifiers_rl.config.sharding import size_zero3_buckets_on_cpu

    def accelerator(zero):
        ds = HfTrainerDeepSpeedConfig({"zero_optimization": zero})
        return SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(hf_ds_config=ds))), ds

    acc, ds = accelerator({"stage": 3, "reduce_bucket_size": 1000})
    cpu, gpu = SimpleNamespace(type="cpu"), SimpleNamespace(type="cuda")
    assert size_zero3_buckets_on_cpu(acc, cpu) == ["stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"]
    ds.trainer_config_finalize(_args(), SimpleNamespace(config=SimpleNamespace(hidden_size=8)), 10)
    zero = ds.config["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"]) == (1000, int(0.9 * 64))
    assert zero["stage3_param_persistence_threshold"] == 80
    for acc_zero, device in (({"stage": 3}, gpu), ({"stage": 2}, cpu)):
        acc, ds = accelerator(acc_zero)
        assert size_zero3_buckets_on_cpu(acc, device) == [] and ds.config["zero_optimization"] == acc_zero
    assert size_zero3_buckets_on_cpu(SimpleNamespace(state=SimpleNamespace()), cpu) == []  # no DeepSpeed


def test_gpu_prefix_layouts_script_runs_on_cpu_and_its_h100_run_backs_the_cost_model(tmp_path):
    """benchmarks/gpu_prefix_layouts.py runs its checks here (small shapes); in its committed H100 run the cost
    model's pick was the fastest layout of each timed shape (and attention by span, since removed, was slower than
    the dense mask)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = root / "benchmarks" / "gpu_prefix_layouts.py"
    r = subprocess.run([sys.executable, str(script), "--cpu", "--small", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=240)  # fmt: skip
    assert r.returncode == 0 and "all checks passed" in r.stdout, r.stdout + r.stderr
    here = json.loads((tmp_path / "prefix_layouts.json").read_text())
    assert here["checks"][0]["dense_grad_rel_diff"] < 1e-4 and here["timings"][0]["auto_layout"] in ("plain", "dense")
    h100 = json.loads((root / "benchmarks" / "results" / "gpu_prefix_layouts_h100.json").read_text())
    assert "H100" in h100["info"]["gpu"] and not h100["failures"]
    for t in h100["timings"]:
        fastest = min(("plain", "dense"), key=lambda k: t[k]["s"])
        assert t["auto_layout"] == fastest and t["span"]["s"] > t["dense"]["s"]


def _gpu_check(tmp_path, *args, timeout=120):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
    cmd = [sys.executable, str(script), "--cpu", "--out", str(tmp_path), *args]
    r = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    )
    return r, json.loads((tmp_path / "gpu_check.json").read_text())


def test_gpu_check_runs_on_cpu_and_ends_with_its_all_passed_line(tmp_path):
    """benchmarks/gpu_check.py, what a lent GPU machine runs, runs every stage here with --cpu (small shapes)."""
    r, out = _gpu_check(tmp_path, timeout=300)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and lines[-2].startswith("gpu_check: every check passed"), (
        r.stdout[-3000:] + r.stderr[-2000:]
    )
    for name in ("lora-bf16", "full-bf16", "full-bf16-changes"):
        probes = out["stages"][name]["probes"]
        assert [p["server_version"] for p in probes] == ["0", "1", "2", "3"]
    assert [s["diff"] for s in out["stages"]["full-bf16-changes"]["syncs"]] == [False, True, True]


def test_gpu_check_sync_checks_fail_when_the_sync_is_skipped(tmp_path):
    """--break-sync skips every sync after the first: the server's version and its logprobs checks fail, and the
    stage, which then waits for a version that never comes, is killed at its deadline with nothing left behind."""
    r, out = _gpu_check(tmp_path, "--break-sync", "--only", "lora-bf16", "--stage-timeout", "40")
    assert r.returncode == 1 and "gpu_check: " in r.stdout and "check(s) failed" in r.stdout
    failed = [c["what"] for c in out["stages"]["lora-bf16"]["checks"] if c["ok"] is False]
    assert any(w.startswith("(a) server /weight_info") for w in failed), failed
    assert any(w.startswith("(b) served logprobs of the fixed prompt moved") for w in failed), failed
    assert not any(w.startswith("nothing it started outlives it") for w in failed), failed


def test_the_committed_h200_runs_of_the_trainer_with_the_cpu_engine_passed():
    """The H200 runs of the trainer on CUDA with our CPU engine (docs/gpu-status.md; the script then was
    benchmarks/gpu_trainer_cpu_engine.py, now benchmarks/gpu_check.py): every variant passed, bf16 weights included."""
    from pathlib import Path

    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    first = json.loads((results / "gpu_trainer_cpu_engine_h200_before_fix.json").read_text())
    after = json.loads((results / "gpu_trainer_cpu_engine_h200.json").read_text())
    assert "H200" in first["info"]["gpu"] and "H200" in after["info"]["gpu"] and not after["failed"]
    passed = {n for run in (first, after) for n, v in run["variants"].items() if all(c["ok"] for c in v["checks"])}
    assert passed == {"a-lora-merged-fp32", "b-lora-adapter-fp32", "c-full-fp32", "d-lora-bf16", "g-full-bf16",
                      "e-full-fp32-socket-1mb", "f-lora-merged-fp32-shm-1mb"}  # fmt: skip
    for name in ("d-lora-bf16", "g-full-bf16"):  # the bf16 weights the fix was run for
        v = after["variants"][name]
        assert v["param_devices"] == ["cuda"] and "bfloat16" in v["param_dtypes"] and v["server_weight_version"] == "4"


def test_the_cpu_engine_beside_gpus_is_described_on_the_cpu():
    """`vf-rl --dry-run` with `[inference] engine = "cpu"` on a GPU machine (as run on an H200, gpu-status.md): the
    server holds its weights in host memory, so the plan does not say it shares or sits on a GPU."""
    from verifiers_rl.plan.devices import GpuPlan

    gpus = GpuPlan(cuda=1, inference=[0], trainer=[0], shared=True)
    assert gpus.describe("cpu") == "1 CUDA device(s): trainer on [0]; the CPU engine serves on the CPU (no GPU)"
    assert "inference shares GPU 0" in gpus.describe("vllm")
    kw = dict(mode="spawn", shared_gpu=False, lora_sync="merged", sync_backend="gloo", server_pauses=True)
    assert ServingPlan(engine="cpu", server_gpus=(0,), **kw).describe()[0] == "engine cpu, spawned on the CPU"
    assert ServingPlan(engine="vllm", server_gpus=(1,), **kw).describe()[0] == "engine vllm, spawned on GPU 1"

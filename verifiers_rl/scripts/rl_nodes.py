"""`vf-rl --dry-run --nodes N --gpus G`: the commands of a run over N machines of G GPUs each.

Node 0 serves: vLLM on its GPUs ([inference] gpus, data parallel x tensor parallel as on one machine), bound to
every interface with the control routes open to the trainer's machines (`--allow-remote-control`; every control
request still needs the run's token). Nodes 1..N-1 train: `accelerate launch` over all their GPUs as one world
(`--num_machines N-1`, rendezvous at node 1), DDP or the accelerate config's ZeRO-3 / FSDP2. Rank 0 of the trainer
(on node 1) is the only process that talks to the server: it connects to node 0 (`server_mode = "connect"`) and
syncs over NCCL across the network (the weight-sync store listens on the address node 1 reaches node 0 from).
vLLM data parallel across several inference machines uses vLLM's own flags (docs/scaling.md).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from verifiers_rl.config.net import DEFAULT_PORT
from verifiers_rl.config.run_file import RunFile
from verifiers_rl.errors import ConfigError
from verifiers_rl.plan.layout import flag_value
from verifiers_rl.scripts.common import resolve_model

RENDEZVOUS_PORT = 29500


def node_commands(run: RunFile, overrides: list[str], nodes: int, gpus: int) -> list[tuple[str, str]]:
    """[(node, command line)] with placeholders $NODE0, $NODE1 (host names) and $VF_CONTROL_TOKEN (the run's
    secret, exported on every node)."""
    if nodes < 2:
        raise ConfigError("--nodes plans a run over several machines: give 2 or more")
    n_inf = run.inference.gpus or gpus
    if n_inf > gpus:
        raise ConfigError(f"inference.gpus={n_inf} exceeds the {gpus} GPUs of node 0 (--gpus is per node)")
    model, args = _model(run), run.rl_config(cuda=False, quiet=True)
    tp = int(flag_value(args.server_args or [], "tensor-parallel-size") or 1)
    if n_inf % tp:
        raise ConfigError(f"inference.gpus={n_inf} is not a multiple of inference.args.tensor_parallel_size={tp}")
    port = str(args.vllm_server_port or DEFAULT_PORT)
    server = ["vf-vllm", "--model", model, "--host", "0.0.0.0", "--port", port, "--allow-remote-control"]
    server += ["--max-model-len", str(args.server_max_len), "--data-parallel-size", str(n_inf // tp)]
    server += args.server_args or []  # as the one-machine launch writes them
    devices = ",".join(map(str, range(n_inf)))
    out = [("node 0 (inference)", f"CUDA_VISIBLE_DEVICES={devices} {shlex.join(server)}")]
    machines, per_node = nodes - 1, gpus
    accelerate = run.trainer.accelerate_config
    launch = ["accelerate", "launch"]
    if accelerate:
        launch += ["--config_file", str(Path(accelerate))]
    else:
        launch += ["--multi_gpu"]
    for rank in range(machines):
        cmd = [*launch, "--num_processes", str(machines * per_node), "--num_machines", str(machines)]
        cmd += ["--machine_rank", str(rank), "--main_process_ip", "$NODE1", "--main_process_port", str(RENDEZVOUS_PORT)]
        cmd += ["-m", "verifiers_rl.scripts.train", "@", str(run.path), *overrides]
        cmd += ["--trainer.args.server_mode", "connect", "--trainer.args.vllm_server_host", "$NODE0"]
        cmd += ["--trainer.args.vllm_server_port", port]
        line = " ".join(a if a.startswith("$") else shlex.quote(a) for a in cmd)
        out.append((f"node {rank + 1} (trainer, {per_node} GPUs)", f"VF_CONTROL_TOKEN=$VF_CONTROL_TOKEN {line}"))
    return out


def _model(run: RunFile) -> str:
    """The model the server loads: the SFT warm-start's output when the config has one (run `vf-sft` first)."""
    if run.sft_file is not None:
        from verifiers_rl.scripts.sft import sft_plan

        return sft_plan(run.sft_file).final_dir
    return resolve_model(run, dry_run=True)


def print_nodes(run: RunFile, overrides: list[str], nodes: int, gpus: int) -> None:
    print(f"# {nodes} machines x {gpus} GPUs: node 0 serves, nodes 1..{nodes - 1} train (one world)")
    print("# on every node: export VF_CONTROL_TOKEN=<the same secret>; NODE0/NODE1 are the machines' host names")
    for node, line in node_commands(run, overrides, nodes, gpus):
        print(f"\n# {node}\n{line}")

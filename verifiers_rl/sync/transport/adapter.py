"""Adapter-only LoRA sync: the LoRA A/B matrices (1-2% of a merged sync's bytes) go into the server's LoRA
slot for the policy adapter; the base weights never move. Per sync (the client pauses generation around it):

    POST /collective_rpc {"method": "vf_lora_update", "args": [AdapterUpdate.to_json()]}
        while the trainer broadcasts the tensors in buckets over the gloo group of /init_weight_transfer_engine
    POST /reset_prefix_cache
    POST /update_weight_version {"new_version": "<policy version>"}

The RPC's result is `{"error": reason}` when the server refuses the update (DoRA, biases, modules_to_save, a
rank above --max-lora-rank, a module the model lacks); it drains the buckets first and keeps the old adapter.
Every receiving rank also leaves its result in the trainer's store (`gloo.publish_report`): vLLM's
/collective_rpc answers with the first data-parallel engine's results only. vLLM's workers install it in place of
the adapter registered at startup (`vllm/lora.LoraSyncExtension`); our CPU engine applies W = W0 + B @ A on
pristine base weights. `/collective_rpc` rather than `/update_weights`: vLLM drops every LoRA adapter at
`/finish_weight_update`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from verifiers_rl.plan.layout import WORKER_EXTENSION
from verifiers_rl.sync.buckets import UpdateInfo
from verifiers_rl.sync.sender import NamedTensors, SyncStats
from verifiers_rl.sync.stream import as_stream
from verifiers_rl.sync.transport.gloo import GlooSender

UPDATE_RPC = "vf_lora_update"
INFO_RPC = "vf_lora_info"
# vLLM numbers adapters from 1 in registration order; ours is the only `--lora-modules` entry.
LORA_INT_ID = 1


@dataclass
class AdapterUpdate:
    """The argument of `vf_lora_update` (a JSON string: vLLM's /collective_rpc passes strings only)."""

    update_info: UpdateInfo  # its `report` names where every receiving rank leaves its result in the group's store
    peft_config: dict
    lora_int_id: int = LORA_INT_ID

    @property
    def report(self) -> str:
        return self.update_info.report

    def to_json(self) -> str:
        body = {"update_info": self.update_info.to_dict(), "peft_config": self.peft_config}
        return json.dumps({**body, "lora_int_id": self.lora_int_id})

    @classmethod
    def parse(cls, text: str) -> AdapterUpdate:
        try:
            body = json.loads(text)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{UPDATE_RPC}: argument is not JSON: {e}") from None
        required = {"update_info", "peft_config", "lora_int_id"}
        # a top-level "report" is how 0.3.x senders named the report id; it now travels in update_info
        if not isinstance(body, dict) or not required <= set(body) <= required | {"report"}:
            keys = sorted(body) if isinstance(body, dict) else type(body).__name__
            raise ValueError(f"{UPDATE_RPC}: expected keys update_info, peft_config, lora_int_id; got {keys}")
        if not isinstance(body["peft_config"], dict):
            raise ValueError(f"{UPDATE_RPC}: peft_config must be an object")
        info, config = UpdateInfo.parse(body["update_info"]), body["peft_config"]
        info.report = info.report or str(body.get("report") or "")
        return cls(info, config, int(body["lora_int_id"]))


def lora_module(name: str) -> tuple[str, str]:
    """`base_model.model.<module>.lora_A.weight` -> (`<module>`, `lora_A`); anything else is a ValueError."""
    parts = name.split(".")
    if len(parts) < 5 or parts[:2] != ["base_model", "model"] or parts[-1] != "weight":
        raise ValueError(f"{name!r} is not a peft LoRA tensor name (base_model.model.<module>.lora_A.weight)")
    if parts[-2] not in ("lora_A", "lora_B"):
        raise ValueError(f"{name!r}: adapter sync carries lora_A / lora_B weights only")
    return ".".join(parts[2:-2]), parts[-2]


def write_served_adapter(weights, directory: str | os.PathLike) -> Path:
    """Write `policy_weights.adapter_weights(model)` as a peft adapter directory (adapter_config.json +
    adapter_model.safetensors): the step-0 adapter a vLLM server registers at startup with `--lora-modules`."""
    from safetensors.torch import save_file

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    save_file({n: t.detach().contiguous() for n, t in weights}, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(weights.peft_config, indent=1))
    return path


def adapter_serving(model, directory: str | os.PathLike):
    """For a trainer that spawns vLLM in adapter mode: write the model's current adapter to `directory` and
    return the `layout.AdapterServing` to start the server with (requests then name `serving.name`)."""
    from verifiers_rl.plan.layout import ADAPTER_NAME, AdapterServing
    from verifiers_rl.sync.policy_weights import adapter_weights

    weights = adapter_weights(model)
    return AdapterServing(ADAPTER_NAME, str(write_served_adapter(weights, directory)), weights.rank)


class AdapterSender(GlooSender):
    """Trainer side of adapter sync; `send` takes `policy_weights.adapter_weights(model)`."""

    backend = "adapter"
    server_info: dict | None = None  # the server's answer to vf_lora_info

    def init(self) -> None:
        # Ask first: a server without our worker extension or LoRA enabled would otherwise fail the RPC only
        # after the trainer has started broadcasting, and the trainer would wait out the group timeout.
        try:
            self.server_info = (self.post("/collective_rpc", {"method": INFO_RPC}).get("results") or [{}])[0]
        except Exception as e:
            raise RuntimeError(
                "adapter sync (lora_sync='adapter') needs a server that takes LoRA updates: our CPU engine, or vLLM "
                "started with --enable-lora --lora-modules <name>=<dir> --worker-extension-cls "
                f"{WORKER_EXTENSION} (layout.AdapterServing); the server said: {e}"
            ) from e
        super().init()

    def send(self, named_tensors: NamedTensors, version: int) -> SyncStats:
        if self.group is None:
            raise RuntimeError("call init() before send()")
        config = getattr(named_tensors, "peft_config", None)
        if config is None:
            raise TypeError("adapter sync sends policy_weights.adapter_weights(model): tensors with their peft config")
        max_rank, rank = (self.server_info or {}).get("max_lora_rank"), getattr(named_tensors, "rank", 0)
        if max_rank and rank > max_rank:
            raise ValueError(
                f"LoRA rank {rank} exceeds the server's --max-lora-rank {max_rank}; restart it with a "
                "larger one (layout.AdapterServing derives it from the adapter)"
            )
        t0 = time.perf_counter()
        tensors = as_stream(named_tensors)

        def rpc(info: UpdateInfo) -> dict:
            return {"method": UPDATE_RPC, "args": [AdapterUpdate(info, config).to_json()]}

        sent, buckets = self._move(tensors, version, rpc, path="/collective_rpc")
        # The prefix cache is keyed by adapter name and path, which stay the same: blocks computed with the old
        # adapter would be served again.
        self.client.reset_prefix_cache(timeout=self.timeout_s)
        self.post("/update_weight_version", {"new_version": str(version)})
        return SyncStats(time.perf_counter() - t0, sent, len(tensors.metas), buckets, version)


def write_zero_adapter(model_name: str, args, directory) -> None:
    """The adapter a vLLM server is started with when the trainer runs in another process (vf-rl): the trainer's
    LoRA layout (targets, ranks, patterns, as `RLTrainer` builds it) with zero weights. It serves exactly the base
    model, as the trainer's step-0 policy does (peft initialises B to zero), and the trainer's first sync replaces
    it before any rollout. Shapes come from the model's config on the meta device: no weights are loaded."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from verifiers_rl.config.lora import run_lora_config, wrap_lora
    from verifiers_rl.model_source import resolve_model_path
    from verifiers_rl.sync.policy_weights import AdapterWeights, adapter_weights

    config = AutoConfig.from_pretrained(resolve_model_path(model_name))
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    peft = wrap_lora(model, run_lora_config(args))
    shapes = adapter_weights(peft)  # meta tensors: names, shapes and the unit-scaling config
    zeros = [(name, torch.zeros(t.shape, dtype=torch.float32)) for name, t in shapes]
    write_served_adapter(AdapterWeights(zeros, shapes.peft_config, shapes.ranks), directory)

"""The worker extension every vLLM server started by `vf-vllm` gets (`--worker-extension-cls`): adapter sync
(`lora.py`), and what the trainer asks the workers about themselves before it plans: the GPUs they run on.

vLLM mixes the class into every worker; `POST /collective_rpc {"method": ...}` calls a method on each and lists
their answers. Nothing here imports vLLM at module level: the trainer imports `reported_gpus` without vLLM.
"""

from __future__ import annotations

from verifiers_rl.rl.inference.vllm.lora import LoraSyncExtension

DEVICE_RPC = "vf_device_uuids"


class WorkerExtension(LoraSyncExtension):
    def vf_device_uuids(self) -> str:
        """This worker's GPU by UUID (the name a GPU has in every process); "" for a worker without one."""
        import torch

        device = getattr(self, "device", None)
        if device is None or getattr(device, "type", "cpu") != "cuda" or not torch.cuda.is_available():
            return ""
        return str(torch.cuda.get_device_properties(device).uuid)


def reported_gpus(client) -> list[str] | None:
    """The GPU UUIDs of a vLLM server's workers, from `vf_device_uuids`; None when the server does not say (vLLM
    started without our extension, or an error), so the trainer plans without knowing them."""
    try:
        results = client.post("/collective_rpc", {"method": DEVICE_RPC}).get("results")
    except Exception:  # noqa: BLE001 - any failure means "not known"
        return None
    if not isinstance(results, list) or not all(isinstance(r, str) for r in results):
        return None
    return [r for r in results if r]

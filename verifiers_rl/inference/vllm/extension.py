"""The worker extension every vLLM server started by `vf-vllm` gets (`--worker-extension-cls`): adapter sync
(`lora.py`), and what the trainer asks the workers before it plans (`serving.session.reported_gpus`). vLLM mixes
it into every worker; `POST /collective_rpc {"method": ...}` calls a method on each. No vLLM import here."""

from __future__ import annotations

from verifiers_rl.inference.vllm.lora import LoraSyncExtension


class WorkerExtension(LoraSyncExtension):
    def vf_device_uuids(self) -> str:
        """This worker's GPU by UUID (the name a GPU has in every process); "" for a worker without one."""
        import torch

        device = getattr(self, "device", None)
        if device is None or getattr(device, "type", "cpu") != "cuda" or not torch.cuda.is_available():
            return ""
        return str(torch.cuda.get_device_properties(device).uuid)

    def vf_served_model(self) -> dict:
        """What this worker runs, for a trainer about to sync into it (serving/identity.py): the shape-deciding
        config entries of its model and its weight-transfer backend (None: started without one)."""
        from verifiers_rl.serving.identity import describe

        transfer = getattr(self.vllm_config, "weight_transfer_config", None)
        return {
            "config": describe(self.vllm_config.model_config.hf_config),
            "backend": getattr(transfer, "backend", None),
        }

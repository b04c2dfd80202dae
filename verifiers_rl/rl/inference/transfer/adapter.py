"""Adapter-only sync: the LoRA A/B matrices of each module (about 1% of a merged sync's bytes), sent over the
gloo group; the server keeps pristine base weights and applies W = W0 + scaling * B @ A.

The tensors come from `policy_weights.adapter_weights` (the LoRA scaling is already folded into B, so the
server multiplies by `lora_scaling` = 1.0).
"""

from __future__ import annotations

from verifiers_rl.rl.inference.transfer.buckets import DEFAULT_BUCKET_BYTES, TensorMeta, UpdateInfo
from verifiers_rl.rl.inference.transfer.gloo import GlooSender


class AdapterSender(GlooSender):
    backend = "adapter"

    def __init__(self, client, *, host: str = "127.0.0.1", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 timeout_s: float = 300.0, lora_scaling: float = 1.0):  # fmt: skip
        super().__init__(client, host=host, bucket_bytes=bucket_bytes, timeout_s=timeout_s)
        self.lora_scaling = lora_scaling

    def update_info(self, metas: list[TensorMeta]) -> UpdateInfo:
        return UpdateInfo.from_metas(metas, lora_scaling=self.lora_scaling)

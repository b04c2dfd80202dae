"""The weight-sync backends by name: one module each (gloo, adapter, NCCL), imported only when chosen, so the
client loads without torch.distributed's extras or vLLM."""

from __future__ import annotations

from verifiers_rl.config.choices import Transport, values
from verifiers_rl.config.net import LOOPBACK
from verifiers_rl.sync.sender import WeightSender


def create_sender(
    backend: str,
    client,
    *,
    host: str = LOOPBACK,
    bucket_bytes: int | None = None,
    timeout_s: float = 300.0,
    changed_only: bool = False,
) -> WeightSender:
    """`backend`: 'gloo' (merged weights over a gloo group), 'adapter' (LoRA A/B only, into the server's LoRA
    slot for the policy adapter) or 'nccl' (vLLM's own packed NCCL engine; GPU only). `changed_only`: after the
    first sync, send only the elements that changed (delta.py; vLLM's sparse_nccl engine over NCCL)."""
    from verifiers_rl.sync.buckets import DEFAULT_BUCKET_BYTES

    if changed_only and backend not in (Transport.GLOO, Transport.NCCL):
        raise ValueError(
            f"sending only what changed (sync_changed_only) needs whole-weight sync over gloo or nccl, not {backend!r}"
        )
    kwargs = {"host": host, "bucket_bytes": bucket_bytes or DEFAULT_BUCKET_BYTES, "timeout_s": timeout_s}
    if backend == Transport.GLOO:
        from verifiers_rl.sync.transport.gloo import GlooSender

        return GlooSender(client, changed_only=changed_only, **kwargs)
    if backend == Transport.ADAPTER:
        from verifiers_rl.sync.transport.adapter import AdapterSender

        return AdapterSender(client, **kwargs)
    if backend == Transport.NCCL:
        from verifiers_rl.sync.transport.nccl import NCCLSender
        from verifiers_rl.sync.transport.sparse_nccl import SparseNCCLSender

        return (SparseNCCLSender if changed_only else NCCLSender)(client, **kwargs)
    raise ValueError(f"weight-sync backend={backend!r}; allowed: {', '.join(values(Transport))}")

"""Changes only over NCCL: vLLM's own `sparse_nccl` engines, fed from our snapshot (sync/delta.py).

vLLM's sparse backend (the server started with `--weight-transfer-config '{"backend": "sparse_nccl"}'`) takes flat
int32 indices and values per checkpoint tensor, written on each worker through the model's own loader into the
live parameters. It takes sparse patches only, so a tensor that travels whole (the first sync, a replaced server,
a tensor that changed almost everywhere) is a patch of every index: 3x its bf16 bytes. Tensors go out in chunks of
about a bucket, one `/update_weights` each. vLLM's workers report nothing about what they loaded: the mismatch
guard (guard.py) is the check.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from verifiers_rl.sync.delta import Changes, Outgoing, Sparse, index_dtype
from verifiers_rl.sync.transport.nccl import NCCLSender


def _patch(name: str, update: Sparse | torch.Tensor, shape: tuple[int, ...], device: torch.device | None):
    """The patch on the communicator's `device`: a tensor may lie elsewhere (ZeRO-3's offload keeps it on the CPU)."""
    if index_dtype(math.prod(shape)) != torch.int32:  # a Sparse index there is int64, which int32 would wrap
        raise ValueError(f"{name} has {math.prod(shape)} elements; vLLM's sparse_nccl indexes with int32")
    from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseWeightPatch

    if isinstance(update, Sparse):
        index, values = update.index.to(device=device, dtype=torch.int32), update.values.reshape(-1).to(device)
    else:
        values = update.reshape(-1).to(device)
        index = torch.arange(values.numel(), dtype=torch.int32, device=values.device)
    return SparseWeightPatch(name, index, values, shape)


def patch_nbytes(patch) -> int:
    return patch.indices.numel() * patch.indices.element_size() + patch.values.numel() * patch.values.element_size()


class SparseNCCLSender(NCCLSender):
    """`NCCLSender`'s init and control, vLLM's sparse engine for the bytes, `Changes` for what changed."""

    def __init__(self, client, **kwargs):
        super().__init__(client, **kwargs)
        self.changes = Changes()

    def init(self) -> None:
        try:
            from vllm.distributed.weight_transfer.sparse_nccl_engine import (
                SparseNCCLTrainerInitInfo,
                SparseNCCLTrainerWeightTransferEngine,
            )
        except ImportError as e:
            raise RuntimeError(
                "sync_changed_only over NCCL needs vLLM >= 0.32 in the trainer's environment (its sparse_nccl "
                "engine: pip install 'verifiers-rl[vllm]'); on CPU use the gloo backend"
            ) from e
        self._init_with(SparseNCCLTrainerInitInfo, SparseNCCLTrainerWeightTransferEngine)

    def _wire_params(self) -> dict:
        return {}  # sparse patches are never packed

    def _engine(self, engine_cls, info):
        return engine_cls(client=self.control)

    def relabel(self, version: int, was: int | None) -> None:
        self.changes.relabel(version, was)

    def _chunks(self, out: Outgoing) -> Iterator[list]:
        """The sync's patches (changes, or every element of every tensor) in chunks of about a bucket."""
        shapes = {m.name: tuple(m.shape) for m in out.targets}
        chunk, size = [], 0
        for name, update in out.updates():
            patch = _patch(name, update, shapes[name], self.device)
            chunk.append(patch)
            size += patch_nbytes(patch)
            if size >= self.bucket_bytes:
                yield chunk
                chunk, size = [], 0
        if chunk:
            yield chunk

    def _transfer(self, stream, version: int) -> tuple[int, int]:
        sent, chunks = 0, 0
        with self.changes.sending(stream, self.client.weight_version, version) as out:
            self.control.start_weight_update()
            for chunk in self._chunks(out):
                self.engine.send_weight_chunk(chunk)
                sent, chunks = sent + sum(map(patch_nbytes, chunk)), chunks + 1
                self.sent += len(chunk)
            self.control.finish_weight_update(str(version))
        return sent, chunks

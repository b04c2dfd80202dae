"""The `gloo` weight-transfer engine vLLM's workers run (registered by `plugin.register`): it receives the
trainer's bucketed gloo broadcasts (sync/transport/gloo.py) and loads them through the model's own `load_weights`,
under vLLM's layerwise reload for whole tensors, in place for a sync of changes only (`delta.Receiving.through`).
Per sync: /start_weight_update, /update_weights (receive buckets, load, report), /finish_weight_update (finalize
the reload), /reset_prefix_cache. This module imports vLLM: only vLLM's workers import it.
"""

from __future__ import annotations

import contextlib
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferEngine

from verifiers_rl.inference.vllm.plugin import worker_rank
from verifiers_rl.sync import delta
from verifiers_rl.sync.buckets import DEFAULT_BUCKET_BYTES, UpdateInfo, plan_buckets
from verifiers_rl.sync.transport.gloo import GlooInitInfo, connect_group, publish_report, receive_buckets
from verifiers_rl.sync.verify import tensor_checksum


def _retie_cpu_lm_head(model, model_config) -> None:
    """Re-pack a tied lm_head after a reload on CPU: vLLM's CPU linear kernels run from a packed copy of the weight,
    and layerwise reload only processes the embedding the head shares, so the head would keep the old weights."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    lm_head = getattr(model, "lm_head", None)
    if lm_head is None or not hasattr(lm_head, "cpu_linear") or getattr(lm_head.weight, "is_meta", True):
        return
    hf_config = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    if not getattr(hf_config, "tie_word_embeddings", False):
        return
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)


class _DrainingLoader:
    """A bucket callback that loads until one load fails, then keeps taking (and dropping) the rest: the trainer
    is mid-broadcast and would otherwise wait out the group timeout before it learns anything. Each tensor is copied
    out of the receive buffer first (layerwise reload keeps it until the whole layer, which can straddle buckets,
    has arrived) and checksummed as it is handed to `load_weights`: vLLM's own parameters are fused and sharded."""

    def __init__(self, load_weights, device):
        self.load_weights, self.device = load_weights, device
        self.error: Exception | None = None
        self.sums: dict[str, int] = {}

    def __call__(self, items) -> None:
        if self.error is None:
            try:
                copies = [(n, t.to(self.device, copy=True)) for n, t in items]
                self.sums.update((n, tensor_checksum(t)) for n, t in copies)
                self.load_weights(copies)
            except Exception as e:  # noqa: BLE001 - raised by `check`, once every bucket has arrived
                self.error = e

    def report(self, names: list[str]) -> dict:
        """This worker's answer for the trainer's store: its checksums in the sync's order, or its error."""
        if self.error is not None:
            return {"error": f"{type(self.error).__name__}: {self.error}"}
        return {"checksums": [self.sums.get(n) for n in names]}

    def check(self) -> None:
        if self.error is not None:
            raise ValueError(f"weight update failed: {type(self.error).__name__}: {self.error}") from self.error


class _ChangeLoader(_DrainingLoader):
    """`_DrainingLoader` for a sync of changes only, written into the live parameters and compared where they
    landed (`delta.Receiving.through`); a tensor whose changes did not land reports checksum 0 (no tensor's: the
    length is mixed in), so the trainer names it."""

    def __init__(self, model, changes: delta.Receiving, device):
        super().__init__(self._load, device)
        self.model, self.changes = model, changes
        # vLLM's CPU build repacks every linear layer for its kernels and empties the parameter: a change has
        # nowhere to be written there
        packed = next((name for name, p in model.named_parameters() if p.numel() == 0), None)
        if packed is not None:
            self.error = ValueError(
                f"this vLLM keeps {packed} only repacked for its kernels (vLLM's CPU build does so with every linear "
                "layer), so changed elements cannot be written in place: a sync of changes only (sync_changed_only) "
                "needs vLLM on a GPU or the CPU engine"
            )

    def _load(self, copies) -> None:
        self.sums.update((n, 0) for n in self.changes.through(copies, self.model.load_weights))


def _loader_for(engine, update_info: UpdateInfo) -> _DrainingLoader:
    """The bucket callback for one update: changes only are written into the live parameters; whole tensors load
    under layerwise reload, started with the session's first whole tensors."""
    changes = delta.receiving(update_info)
    if changes is not None:
        return _ChangeLoader(engine.model, changes, engine.device)
    if not engine._reloading:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(engine.model)
        engine._reloading = True
    return _DrainingLoader(engine.model.load_weights, engine.device)


class GlooWeightTransferEngine(WeightTransferEngine):
    """Receives bucketed gloo broadcasts from the trainer and loads them with layerwise reload."""

    init_info_cls = GlooInitInfo
    update_info_cls = UpdateInfo
    # Draft models would need their own name mapping on the trainer side; not offered yet.
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self._group = None
        self._bucket_bytes = DEFAULT_BUCKET_BYTES
        self._reloading = False

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        if self._group is not None:
            # A restarted trainer re-initializes: drop the stale group rather than keep two.
            self.shutdown()
        rank = init_info.rank_offset + worker_rank(self.parallel_config)
        if rank >= init_info.world_size:
            raise ValueError(f"worker rank {rank} does not fit world_size={init_info.world_size}")
        self._bucket_bytes = init_info.bucket_bytes
        self._group = connect_group(init_info, rank)

    def start_weight_update(self) -> None:
        # Layerwise reload (parameters swapped out until each layer's tensors have all arrived) starts with the
        # first whole tensors (`receive_weights`): a sync of changes only writes into the live parameters.
        self._reloading = False

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on a CPU-only host.
        # gloo receives are synchronous, so there is nothing to wait for.
        self.receive_weights(self.parse_update_info(update_info))

    def joined(self):
        if self._group is None:
            raise RuntimeError("gloo weight transfer is not initialized: POST /init_weight_transfer_engine first")
        return self._group

    def receive(self, metas, on_bucket) -> None:
        """Receive one sync's buckets on this worker's group; also used by the LoRA worker extension."""
        receive_buckets(self.joined(), plan_buckets(metas, self._bucket_bytes), on_bucket)

    def report(self, sync_id: str, result: dict) -> None:
        """Leave this worker's answer to an update in the trainer's store (see `gloo.publish_report`)."""
        publish_report(self.joined(), sync_id, result)

    def receive_weights(self, update_info: UpdateInfo) -> None:
        # vLLM's NCCL backend loads under this guard so a partial (no-MTP-head) checkpoint is accepted
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        loader = _loader_for(self, update_info)
        with disable_mtp_completeness_check():
            self.receive(update_info.metas(), loader)
        if update_info.report:
            self.report(update_info.report, loader.report(update_info.names))
        loader.check()

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self._reloading:
            finalize_layerwise_reload(self.model, self.model_config)
            _retie_cpu_lm_head(self.model, self.model_config)
        self._reloading = False

    def shutdown(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            # Best effort: the trainer may already be gone, and a dead peer must not fail the worker.
            with contextlib.suppress(Exception):
                group.pg.shutdown()

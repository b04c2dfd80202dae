"""Server side of a weight sync into the CPU engine: full tensors over the gloo group (`/update_weights`) and
adapter updates (`/collective_rpc vf_lora_update`), with the same init_info/update_info as our vLLM plugin."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from verifiers_rl.sync import delta
from verifiers_rl.sync.buckets import DEFAULT_BUCKET_BYTES, UpdateInfo, plan_buckets
from verifiers_rl.sync.policy_weights import unsupported_adapter_features
from verifiers_rl.sync.transport import adapter, gloo
from verifiers_rl.sync.transport.shm import SharedSlots
from verifiers_rl.sync.verify import tensor_checksum

if TYPE_CHECKING:
    from verifiers_rl.inference.cpu.engine_api import ServingEngine


class WeightReceiver:
    def __init__(self, engine: ServingEngine):
        self.engine = engine
        self.pg = None
        self.bucket_bytes = DEFAULT_BUCKET_BYTES
        self.paused_by_update = False

    def init(self, info: dict[str, Any]) -> bool:
        """Join the trainer's group; True when the buckets will come through its shared memory (shm.py)."""
        init = gloo.GlooInitInfo.parse(info)
        self.bucket_bytes = init.bucket_bytes
        self.pg = gloo.connect_group(init, rank=init.rank_offset)
        if init.shm_path and init.world_size == 2:
            self.pg.shm = SharedSlots.open(init.shm_path, init.shm_nonce, init.bucket_bytes)
        return self.pg.shm is not None

    def start(self) -> None:
        if not self.engine.is_paused:
            self.engine.pause()
            self.paused_by_update = True

    def update(self, info: dict[str, Any]) -> int:
        update = UpdateInfo.parse(info)  # a malformed body is refused before anything else
        metas = update.metas()
        if self.pg is None:
            raise ValueError("call /init_weight_transfer_engine before /update_weights")
        if not self.engine.is_paused:  # vLLM allows updates without /start_weight_update; stay consistent
            self.start()
        changes = delta.receiving(update, served=self.engine.version)  # a malformed header: refused before any byte
        loaded, error, load = 0, changes and changes.refused, self.engine.load_weights

        def on_bucket(named):
            # After a failure keep receiving (and dropping) the remaining buckets: the trainer is mid-broadcast
            # and would otherwise block until the gloo timeout.
            nonlocal loaded, error
            if error is None:
                try:
                    loaded += load(changes.updates(named), write=delta.apply) if changes else load(named)
                except (KeyError, ValueError, RuntimeError) as e:
                    error = e

        buckets = plan_buckets(metas, self.bucket_bytes)
        placed = []

        def place(bucket):  # a bucket that is a span of the engine's own parameters arrives there directly
            target = self.engine.placement(bucket) if error is None else None
            if target is not None:
                placed.append(len(bucket.metas))
            return target

        gloo.receive_buckets(self.pg, buckets, on_bucket, place)
        loaded += sum(placed)
        if error is not None:
            raise ValueError(f"weight update failed: {error}") from error
        if update.report:  # what the engine now holds, read back: a tensor received but not written shows
            held = changes.targets if changes else metas
            gloo.publish_report(self.pg, update.report, {"checksums": self.engine.weight_checksums(held)})
        return loaded

    def lora_update(self, update_json: str) -> dict[str, Any]:
        """`vf_lora_update` (sync/transport/adapter.py): W = W0 + B @ A on the pristine base weights, B pre-scaled.
        The result is the RPC's answer and, like every receiver's, left in the trainer's store."""
        if self.pg is None:
            raise ValueError(f"call /init_weight_transfer_engine before {adapter.UPDATE_RPC}")
        update = adapter.AdapterUpdate.parse(update_json)
        result = self._lora_update(update)
        if update.report:
            gloo.publish_report(self.pg, update.report, result)
        return result

    def _lora_update(self, update: adapter.AdapterUpdate) -> dict[str, Any]:
        metas = update.update_info.metas()
        paused_here = not self.engine.is_paused
        if paused_here:
            self.engine.pause()
        try:
            pairs: dict[str, dict[str, Any]] = {}
            problems: list[str] = []

            def keep(named):
                for name, t in named:
                    try:
                        module, kind = adapter.lora_module(name)
                    except ValueError as e:
                        problems.append(str(e))
                        continue
                    pairs.setdefault(module, {})[kind] = t.clone()  # a view into the next bucket's buffer

            # drain every bucket before refusing anything: the trainer is mid-broadcast
            gloo.receive_buckets(self.pg, plan_buckets(metas, self.bucket_bytes), keep)
            problems += unsupported_adapter_features(update.peft_config) + _scaling_problems(update.peft_config)
            params = dict(self.engine.model.named_parameters())
            problems += [f"engine model has no parameter {m}.weight" for m in pairs if f"{m}.weight" not in params]
            problems += [f"{m} lacks lora_A or lora_B" for m, ab in pairs.items() if len(ab) != 2]
            if problems:  # refused after the data: an answer, as vLLM's extension gives it
                return {"error": "; ".join(problems[:5])}
            # Checked first, applied after: a refused update leaves the served weights as they were.
            named = [(f"{m}.{kind}", t) for m, ab in pairs.items() for kind, t in ab.items()]
            try:
                modules = self.engine.load_weights(named, lora_scaling=1.0)
            except (KeyError, ValueError) as e:
                return {"error": str(e)}
        finally:
            if paused_here:
                self.engine.resume()
        # W = W0 + B @ A cannot be read back as A and B: the checksums are of the tensors the engine applied
        installed = {f"base_model.model.{m}.{kind}.weight": t for m, ab in pairs.items() for kind, t in ab.items()}
        sums = [tensor_checksum(installed[m.name]) if m.name in installed else None for m in metas]
        return {"tensors": len(metas), "modules": modules, "checksums": sums}

    def abandon(self) -> None:
        """A one-call sync that failed (or finished): serve on with the weights it has."""
        if self.paused_by_update:
            self.engine.resume()
            self.paused_by_update = False

    def finish(self, version: int | None) -> int:
        version = self.engine.finish_update(version)
        self.abandon()
        return version

    def shutdown(self) -> None:
        self.pg = None


def _scaling_problems(config: dict) -> list[str]:
    # The engine adds B @ A as it comes: only the pre-scaled form (policy_weights.unit_scaling_config) fits.
    if config.get("use_rslora") or config.get("lora_alpha") != config.get("r"):
        return ["the CPU engine takes B pre-multiplied by the LoRA scaling (lora_alpha == r, no rsLoRA)"]
    if (config.get("alpha_pattern") or {}) != (config.get("rank_pattern") or {}):
        return ["the CPU engine takes B pre-multiplied by the LoRA scaling (alpha_pattern == rank_pattern)"]
    return []

"""vLLM worker extension for adapter sync (protocol: sync/transport/adapter.py): install the trainer's LoRA tensors
in the policy adapter's slot. vLLM is started with `--enable-lora --lora-modules policy=<step-0 adapter dir>`
(`layout.AdapterServing.vllm_args`) and our gloo weight-transfer backend.

Each sync builds a LoRA model from the received tensors and swaps it in under the same lora_int_id, so requests
already running on the adapter continue on the new weights, and the adapter stays pinned, so vLLM never falls back
to re-reading the step-0 files. Nothing touches a disk. No vLLM import at module level.
"""

from __future__ import annotations

import time


def _unknown_modules(module_names, served: dict, packed: dict[str, list[str]]) -> list[str]:
    """LoRA modules that match no LoRA-wrapped layer of the served model. vLLM serves q/k/v and gate/up
    packed (`qkv_proj`, `gate_up_proj`) and would skip a module it does not know without a word."""
    unknown = []
    for name in module_names:
        prefix, _, leaf = name.rpartition(".")
        candidates = [name] + [f"{prefix}.{p}" if prefix else p for p, subs in packed.items() if leaf in subs]
        if not any(c in served for c in candidates):
            unknown.append(name)
    return sorted(unknown)


class LoraSyncExtension:
    """Methods reached through `POST /collective_rpc`; `self` is a vLLM worker."""

    def _vf_lora_manager(self):
        manager = getattr(self.model_runner, "lora_manager", None)
        if manager is None:
            raise RuntimeError("LoRA is not enabled in this vLLM server: start it with --enable-lora")
        return manager

    def vf_lora_info(self) -> dict:
        """What the trainer checks before its first adapter sync."""
        manager = self._vf_lora_manager()
        return {
            "engine": "vllm",
            "max_lora_rank": manager.lora_config.max_lora_rank,
            "max_loras": manager.lora_config.max_loras,
            "adapters": sorted(manager.list_adapters()),
        }

    def vf_lora_update(self, update_json: str) -> dict:
        from verifiers_rl.sync.transport.adapter import AdapterUpdate
        from verifiers_rl.sync.verify import tensor_checksum

        t0 = time.perf_counter()
        update = AdapterUpdate.parse(update_json)
        engine = getattr(self, "weight_transfer_engine", None)
        if not hasattr(engine, "receive"):
            raise RuntimeError(
                "adapter sync needs our gloo weight transfer: start vLLM with --weight-transfer-config "
                '\'{"backend": "gloo"}\' and POST /init_weight_transfer_engine first'
            )
        tensors = {}

        def keep(items):
            # views into a staging buffer that the next bucket overwrites
            tensors.update((name, t.clone()) for name, t in items)

        # Receive everything before checking anything: the trainer is broadcasting, and a worker that stopped
        # listening would leave it waiting for the group timeout.
        engine.receive(update.update_info.metas(), keep)
        received = time.perf_counter() - t0
        try:
            self._vf_install(update.lora_int_id, tensors, update.peft_config)
            result = {"tensors": len(tensors), "receive_s": received, "install_s": time.perf_counter() - t0 - received}
            # the tensors handed to vLLM's LoRA model, in the update's order (sync/verify.py)
            result["checksums"] = [
                tensor_checksum(tensors[n]) if n in tensors else None for n in update.update_info.names
            ]
        except Exception as e:  # noqa: BLE001 - reported to the trainer, which raises it
            # An answer, not an exception: vLLM's /collective_rpc turns a worker exception into a 500 and then
            # drops the connection, so the trainer's next request (its /resume) would fail too.
            result = {"error": f"{type(e).__name__}: {e}"}
        if update.report:  # the RPC's answer carries the first data-parallel engine's results only
            engine.report(update.report, result)
        return result

    def _vf_install(self, lora_id: int, tensors: dict, peft_config: dict) -> None:
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        from verifiers_rl.sync.policy_weights import unsupported_adapter_features

        problems = unsupported_adapter_features(peft_config)
        if problems:
            raise ValueError(f"adapter sync cannot carry {', '.join(problems)}; use lora_sync='merged'")
        manager = self._vf_lora_manager()
        slots = manager._adapter_manager  # the LoRAModelManager that owns the slots
        helper = PEFTHelper.from_dict({**peft_config, "vllm_max_position_embeddings": manager.max_position_embeddings})
        helper.validate_legal(manager.lora_config)  # rank <= --max-lora-rank, and vLLM's own feature checks
        model = slots.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        lora = LoRAModel.from_lora_tensors(
            lora_model_id=lora_id,
            tensors=tensors,
            peft_helper=helper,
            device="cpu",
            dtype=manager.lora_config.lora_dtype,
            model_vocab_size=manager.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
        unknown = _unknown_modules(lora.loras, slots.modules, slots.packed_modules_mapping)
        if unknown:
            raise ValueError(f"LoRA modules not in the served model: {unknown[:5]} ({len(unknown)} in all)")
        # vLLM's own in-place reload once its files are read: drop the old weights, register, copy into a slot.
        previous = slots.get_adapter(lora_id)
        slots.remove_adapter(lora_id)
        try:
            slots.add_adapter(lora)
            slots.activate_adapter(lora_id)
        except Exception:
            # Put the previous weights back rather than leave the id unregistered: vLLM would then reload the
            # step-0 adapter from disk for the next request and serve it without a word.
            slots.remove_adapter(lora_id)
            if previous is not None:
                slots.add_adapter(previous)
                slots.activate_adapter(lora_id)
                slots.pin_adapter(lora_id)
            raise
        slots.pin_adapter(lora_id)

"""What the trainer sends: a (possibly peft-wrapped) model's weights under the engine's (HF) names.

- merged: every base weight, with each LoRA delta added *out of place* in float32 and cast to the transfer
  dtype. Merging into the trainer's bf16 weights and unmerging after every step drifts the base weights.
- adapter: only the LoRA A/B matrices (about 1% of the bytes) plus `modules_to_save` copies; the engine keeps
  pristine base weights and applies W = W0 + B @ A. The LoRA scaling (alpha/r, rsLoRA, per-module patterns)
  is folded into B, so one rule serves every module.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def _unwrap(model):
    # PeftModel -> LoraModel -> the transformers model whose parameter names the engine knows.
    base = getattr(model, "base_model", None)
    if base is not None and hasattr(base, "peft_config"):
        return base.model, base
    return model, None


def _lora_layers(inner) -> dict[str, torch.nn.Module]:
    from peft.tuners.lora import LoraLayer

    return {name: mod for name, mod in inner.named_modules() if isinstance(mod, LoraLayer)}


def _active_adapter(peft_base) -> str:
    active = peft_base.active_adapter
    return active[0] if isinstance(active, (list, tuple)) else active


def engine_name(name: str, adapter: str = "default") -> str | None:
    """peft parameter name (relative to the transformers model) -> engine name; None for LoRA-only tensors."""
    if ".lora_" in name or ".original_module." in name:
        return None
    return name.replace(f".modules_to_save.{adapter}.", ".").replace(".base_layer.", ".")


def merged_weights(model, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (engine name, tensor) for the full model with LoRA deltas merged out of place."""
    inner, peft_base = _unwrap(model)
    lora = _lora_layers(inner) if peft_base is not None else {}
    adapter = _active_adapter(peft_base) if peft_base is not None else "default"
    with torch.no_grad():
        for name, p in inner.named_parameters():
            out = engine_name(name, adapter)
            if out is None:
                continue
            t = p.detach()
            module = name[: -len(".base_layer.weight")] if name.endswith(".base_layer.weight") else None
            if module in lora and adapter in lora[module].lora_A and not lora[module].merged:
                delta = lora[module].get_delta_weight(adapter)
                t = t.float() + delta.float()
            yield out, t.to(dtype or p.dtype).contiguous()


def adapter_weights(model, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `<module>.lora_A` / `<module>.lora_B` (B pre-scaled) and `modules_to_save` tensors."""
    inner, peft_base = _unwrap(model)
    if peft_base is None:
        raise ValueError("adapter-only sync needs a peft LoRA model; use merged sync for full fine-tuning")
    adapter = _active_adapter(peft_base)
    with torch.no_grad():
        for module, layer in _lora_layers(inner).items():
            if adapter not in layer.lora_A:
                continue
            if getattr(layer, "use_dora", {}).get(adapter, False):
                raise ValueError(f"adapter-only sync does not support DoRA ({module}); use merged sync")
            if getattr(layer, "fan_in_fan_out", False):
                raise ValueError(f"adapter-only sync does not support fan_in_fan_out layers ({module})")
            a = layer.lora_A[adapter].weight.detach()
            b = layer.lora_B[adapter].weight.detach().float() * layer.scaling[adapter]
            yield f"{module}.lora_A", a.to(dtype or a.dtype).contiguous()
            yield f"{module}.lora_B", b.to(dtype or a.dtype).contiguous()
        for name, p in inner.named_parameters():
            if f".modules_to_save.{adapter}." in name:
                yield engine_name(name, adapter), p.detach().to(dtype or p.dtype).contiguous()

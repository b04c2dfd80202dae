"""What the trainer sends: a (possibly peft-wrapped) model's weights under the engine's (HF) names.

- merged: every base weight, with each LoRA delta added *out of place* in float32 and cast to the transfer
  dtype. Merging into the trainer's bf16 weights and unmerging after every step drifts the base weights.
- adapter: only the LoRA A/B matrices (about 1% of the bytes), in peft's names, for a server that keeps the
  base weights and applies W = W0 + B @ A (vLLM's LoRA slots, or our engine on pristine base weights). The
  LoRA scaling (alpha/r, rsLoRA, per-module patterns) is folded into B, so one rule serves every module.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from verifiers_rl.rl.inference.transfer.buckets import TensorMeta
from verifiers_rl.rl.inference.transfer.stream import WeightStream


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


def merged_metas(model, dtype: torch.dtype | None = None) -> list[TensorMeta]:
    """What `merged_weights` yields, described without computing a merge: names, dtypes and shapes, in order."""
    inner, peft_base = _unwrap(model)
    adapter = _active_adapter(peft_base) if peft_base is not None else "default"
    metas = []
    for name, p in inner.named_parameters():
        out = engine_name(name, adapter)
        if out is not None:
            metas.append(TensorMeta(out, dtype or p.dtype, tuple(p.shape)))
    return metas


def merged_stream(model, dtype: torch.dtype | None = None) -> WeightStream:
    """The merged weights as a stream: each merge is computed when the sender reaches its bucket."""
    return WeightStream(merged_metas(model, dtype), lambda: merged_weights(model, dtype))


def merged_weights(model, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (engine name, tensor) for the full model with LoRA deltas merged out of place."""
    inner, peft_base = _unwrap(model)
    lora = _lora_layers(inner) if peft_base is not None else {}
    adapter = _active_adapter(peft_base) if peft_base is not None else "default"
    # No `with torch.no_grad()` around the yields: a consumer that stops early (a failed sync) would leave the
    # generator suspended inside it, and grad mode off in the trainer's thread until garbage collection.
    for name, p in inner.named_parameters():
        out = engine_name(name, adapter)
        if out is None:
            continue
        t = p.detach()
        module = name[: -len(".base_layer.weight")] if name.endswith(".base_layer.weight") else None
        if module in lora and adapter in lora[module].lora_A and not lora[module].merged:
            with torch.no_grad():
                delta = lora[module].get_delta_weight(adapter)
            t = t.float() + delta.float()
        yield out, t.to(dtype or p.dtype).contiguous()


@dataclass
class AdapterWeights:
    """A LoRA adapter as the adapter-sync protocol carries it: peft's on-disk tensor names
    (`base_model.model.<module>.lora_A.weight` / `.lora_B.weight`) with each B pre-multiplied by its module's
    LoRA scaling, and an adapter config that says so (`lora_alpha == r` per module, no rsLoRA). Every reader
    (vLLM's LoRA manager, our CPU engine) then applies W0 + B @ A, so alpha, rsLoRA and rank/alpha patterns
    stay peft's business. Iterates as (name, tensor) pairs, like the merged weights."""

    tensors: list[tuple[str, torch.Tensor]]
    peft_config: dict
    ranks: dict[str, int] = field(default_factory=dict)  # module -> LoRA rank

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors)

    @property
    def rank(self) -> int:
        return max(self.ranks.values(), default=0)

    def stream(self) -> WeightStream:
        metas = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors]
        return WeightStream(metas, lambda: iter(self.tensors), self.peft_config, self.rank)


def unsupported_adapter_features(config: dict) -> list[str]:
    """What adapter-only sync (and vLLM's LoRA support) cannot carry; an empty list when the config is fine."""
    problems = []
    if config.get("use_dora"):
        problems.append("DoRA (use_dora=True)")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        problems.append(f"trained biases (bias={config.get('bias')!r}, lora_bias={config.get('lora_bias')!r})")
    if config.get("modules_to_save"):
        problems.append(f"modules_to_save={sorted(config['modules_to_save'])}")
    return problems


def adapter_weights(model, dtype: torch.dtype | None = None) -> AdapterWeights:
    """The active LoRA adapter of a peft model in the adapter-sync format (see `AdapterWeights`)."""
    inner, peft_base = _unwrap(model)
    if peft_base is None:
        raise ValueError("adapter-only sync needs a peft LoRA model; use merged sync for full fine-tuning")
    adapter = _active_adapter(peft_base)
    config = peft_base.peft_config[adapter]
    problems = unsupported_adapter_features(config.to_dict())
    if problems:
        raise ValueError(f"adapter-only sync cannot carry {', '.join(problems)}; use lora_sync='merged'")
    tensors, ranks = [], {}
    with torch.no_grad():
        for module, layer in _lora_layers(inner).items():
            if adapter in getattr(layer, "lora_embedding_A", {}) or (
                adapter in layer.lora_A and not isinstance(layer.get_base_layer(), torch.nn.Linear)
            ):
                raise ValueError(f"adapter-only sync supports LoRA on linear layers only ({module}); use merged sync")
            if adapter not in layer.lora_A:
                continue
            if getattr(layer, "fan_in_fan_out", False):
                raise ValueError(f"adapter-only sync does not support fan_in_fan_out layers ({module})")
            a = layer.lora_A[adapter].weight.detach()
            # float32 product, then the transfer dtype: the same rounding merged sync applies to its deltas
            b = layer.lora_B[adapter].weight.detach().float() * layer.scaling[adapter]
            prefix = f"base_model.model.{module}"
            tensors.append((f"{prefix}.lora_A.weight", a.to(dtype or a.dtype).contiguous()))
            tensors.append((f"{prefix}.lora_B.weight", b.to(dtype or a.dtype).contiguous()))
            ranks[module] = int(layer.r[adapter])
    if not ranks:
        raise ValueError(f"peft model has no LoRA weights for its active adapter {adapter!r}")
    return AdapterWeights(tensors, unit_scaling_config(ranks), ranks)


def unit_scaling_config(ranks: dict[str, int]) -> dict:
    """An adapter_config.json for pre-scaled B: alpha equals the rank everywhere, so every scaling is 1."""
    r = max(ranks.values())
    # patterns are matched as regexes against module paths (peft's and vLLM's rule): escape the dots
    pattern = {re.escape(m): k for m, k in sorted(ranks.items()) if k != r}
    return {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": r,
        "rank_pattern": pattern,
        "alpha_pattern": dict(pattern),
        "use_rslora": False,
        "use_dora": False,
        "bias": "none",
        "modules_to_save": None,
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in ranks}),
    }

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

from verifiers_rl.sync.buckets import TensorMeta
from verifiers_rl.sync.stream import WeightStream


def unwrap_peft(model):
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


@dataclass(frozen=True)
class ExportItem:
    """One tensor the server loads, and the training parameters it is computed from (`sources`, names relative
    to the transformers model). The plan of a sync is a list of these, made from the model's structure alone:
    no weight is read, so a sharded model is described without gathering anything."""

    name: str  # engine name (merged) or peft's on-disk name (adapter)
    meta: TensorMeta
    sources: tuple[str, ...]  # copy: (param,); merge: (base, lora_A, lora_B); lora_A: (A,); lora_B: (B,)
    role: str  # "copy" | "merge" | "lora_A" | "lora_B"
    scaling: float = 1.0
    fan_in_fan_out: bool = False


def full_shape(p: torch.Tensor) -> tuple[int, ...]:
    """A parameter's whole shape, whatever holds it: DeepSpeed ZeRO-3 keeps `ds_shape` beside an empty local
    tensor; an FSDP2 DTensor reports its global shape."""
    return tuple(getattr(p, "ds_shape", p.shape))


def merged_items(model, dtype: torch.dtype | None = None) -> list[ExportItem]:
    """Every base weight under its engine name; a LoRA'd linear weight is merged with its delta (out of place)."""
    inner, peft_base = unwrap_peft(model)
    lora = _lora_layers(inner) if peft_base is not None else {}
    adapter = _active_adapter(peft_base) if peft_base is not None else "default"
    items = []
    for name, p in inner.named_parameters():
        out = engine_name(name, adapter)
        if out is None:
            continue
        meta = TensorMeta(out, dtype or p.dtype, full_shape(p))
        module = name[: -len(".base_layer.weight")] if name.endswith(".base_layer.weight") else None
        layer = lora.get(module)
        if layer is not None and adapter in layer.lora_A and not layer.merged:
            if not isinstance(layer.get_base_layer(), torch.nn.Linear):
                raise ValueError(f"merged sync supports LoRA on linear layers only ({module})")
            sources = (name, f"{module}.lora_A.{adapter}.weight", f"{module}.lora_B.{adapter}.weight")
            scaling, fan = float(layer.scaling[adapter]), bool(getattr(layer, "fan_in_fan_out", False))
            items.append(ExportItem(out, meta, sources, "merge", scaling, fan))
        else:
            items.append(ExportItem(out, meta, (name,), "copy"))
    return items


def materialize(item: ExportItem, full: dict[str, torch.Tensor]) -> torch.Tensor:
    """The tensor of `item` from whole source tensors. Merges and scales in float32, then casts to the transfer
    dtype, so every layout (replicated, ZeRO-3, FSDP2) rounds the same way."""
    with torch.no_grad():
        if item.role in ("copy", "lora_A"):
            return full[item.sources[0]].detach().to(item.meta.dtype).contiguous()
        if item.role == "merge":
            base, a, b = (full[s].detach() for s in item.sources)
            delta = b.float() @ a.float()
            if item.fan_in_fan_out:
                delta = delta.T
            return (base.float() + delta * item.scaling).to(item.meta.dtype).contiguous()
        if item.role == "lora_B":
            return (full[item.sources[0]].detach().float() * item.scaling).to(item.meta.dtype).contiguous()
    raise ValueError(f"unknown export role {item.role!r}")


def replicated_stream(model, items: list[ExportItem], peft_config: dict | None = None, rank: int = 0):
    """A stream over a model whose every parameter is whole on this rank: each tensor computed when reached."""
    inner, _ = unwrap_peft(model)
    params = dict(inner.named_parameters())

    def produce():
        # No `with torch.no_grad()` around the yields: a consumer that stops early (a failed sync) would leave the
        # generator suspended inside it, and grad mode off in the trainer's thread until garbage collection.
        for item in items:
            yield item.name, materialize(item, {s: params[s] for s in item.sources})

    return WeightStream([i.meta for i in items], produce, peft_config, rank)


def merged_stream(model, dtype: torch.dtype | None = None) -> WeightStream:
    """The merged weights as a stream: each merge is computed when the sender reaches its bucket."""
    return replicated_stream(model, merged_items(model, dtype))


def merged_weights(model, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (engine name, tensor) for the full model with LoRA deltas merged out of place."""
    return iter(merged_stream(model, dtype))


@dataclass
class AdapterWeights:
    """A LoRA adapter as adapter sync carries it: peft's on-disk names (`base_model.model.<module>.lora_A.weight`)
    with each B pre-multiplied by its module's LoRA scaling, and a config that says so (`lora_alpha == r`, no
    rsLoRA). Every reader (vLLM's LoRA manager, our CPU engine) then applies W0 + B @ A, so alpha, rsLoRA and
    rank/alpha patterns stay peft's business. Iterates as (name, tensor) pairs."""

    tensors: list[tuple[str, torch.Tensor]]
    peft_config: dict
    ranks: dict[str, int] = field(default_factory=dict)  # module -> LoRA rank

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors)

    @property
    def rank(self) -> int:
        return max(self.ranks.values(), default=0)


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


def adapter_items(model) -> tuple[list[ExportItem], dict[str, int]]:
    """The active LoRA adapter in the adapter-sync format (see `AdapterWeights`): its items and each module's rank."""
    inner, peft_base = unwrap_peft(model)
    if peft_base is None:
        raise ValueError("adapter-only sync needs a peft LoRA model; use merged sync for full fine-tuning")
    adapter = _active_adapter(peft_base)
    config = peft_base.peft_config[adapter]
    problems = unsupported_adapter_features(config.to_dict())
    if problems:
        raise ValueError(f"adapter-only sync cannot carry {', '.join(problems)}; use lora_sync='merged'")
    params = dict(inner.named_parameters())
    items, ranks = [], {}
    for module, layer in _lora_layers(inner).items():
        if adapter in getattr(layer, "lora_embedding_A", {}) or (
            adapter in layer.lora_A and not isinstance(layer.get_base_layer(), torch.nn.Linear)
        ):
            raise ValueError(f"adapter-only sync supports LoRA on linear layers only ({module}); use merged sync")
        if adapter not in layer.lora_A:
            continue
        if getattr(layer, "fan_in_fan_out", False):
            raise ValueError(f"adapter-only sync does not support fan_in_fan_out layers ({module})")
        prefix, scaling = f"base_model.model.{module}", float(layer.scaling[adapter])
        for kind in ("lora_A", "lora_B"):
            source = f"{module}.{kind}.{adapter}.weight"
            p = params[source]
            # B is pre-scaled in float32, then cast to its own dtype: the rounding merged sync applies to its deltas
            meta = TensorMeta(f"{prefix}.{kind}.weight", p.dtype, full_shape(p))
            items.append(ExportItem(meta.name, meta, (source,), kind, scaling if kind == "lora_B" else 1.0))
        ranks[module] = int(layer.r[adapter])
    if not ranks:
        raise ValueError(f"peft model has no LoRA weights for its active adapter {adapter!r}")
    return items, ranks


def adapter_weights(model) -> AdapterWeights:
    """The active LoRA adapter of a peft model in the adapter-sync format (see `AdapterWeights`), materialised."""
    items, ranks = adapter_items(model)
    tensors = list(replicated_stream(model, items))
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

"""Model and tokenizer loading: a hub id or a local directory, with per-device dtype and attention."""

from __future__ import annotations

import importlib.util
import logging
import os
import warnings
from typing import Any

import torch

from verifiers_rl.model_source import hub_offline, resolve_model_path

__all__ = ["ensure_pad_token", "get_model", "get_model_and_tokenizer", "get_tokenizer", "resolve_model_path"]

logger = logging.getLogger(__name__)

# Tokens tried, in order, as a pad token when a tokenizer has none. Aliasing pad to eos is avoided because
# collators that mask pad positions would then also mask every real eos, and the model never learns to stop.
_PAD_CANDIDATES = ("<|endoftext|>", "<|finetune_right_pad_id|>", "<pad>", "<|pad|>", "[PAD]")
_ADDED_PAD = "<|pad|>"


def default_dtype(device: str) -> torch.dtype:
    if device == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def default_attn_implementation(device: str) -> str:
    if device == "cuda" and torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def training_kwargs(use_lora: bool) -> dict[str, Any]:
    """get_model's model_kwargs for a model the trainer trains. Full fine-tuning keeps float32 master weights (and
    so float32 gradients and AdamW moments); bf16 = true computes under bf16 autocast and the sync sends bf16. In
    bf16 itself a small-lr AdamW update is below half a bf16 ulp for most weights, which then never move. LoRA
    keeps the frozen base in the device's dtype: peft trains the adapters in float32."""
    return {} if use_lora else {"dtype": torch.float32}


def master_weights(model, use_lora: bool):
    """A model handed over in half precision (`vf.get_model` loads bf16 on CUDA) for full fine-tuning, in float32:
    the same master weights `training_kwargs` loads."""
    if use_lora or hasattr(model, "peft_config"):
        return model
    if any(p.requires_grad and p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters()):
        logger.info("full fine-tuning: the model's weights to float32 (master weights; compute follows bf16/fp16)")
        model.to(torch.float32)
    return model


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters as stored (what a decode step reads, and what a full sync moves)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _hub_error(name: str, err: Exception) -> OSError:
    hint = (
        " (HF_HUB_OFFLINE is set: the model must already be in the local cache)"
        if hub_offline()
        else " (check the id, your network, and HF_TOKEN for gated models)"
    )
    return OSError(f"could not load model {name!r} from the Hugging Face hub{hint}: {err}")


def get_model(
    model_name: str,
    use_liger: bool = False,
    model_kwargs: dict[str, Any] | None = None,
    *,
    device: str | None = None,
):
    """Load a causal LM from a hub id or a local path.

    fp32 + SDPA on CPU; bf16 (+ flash-attention when installed) on CUDA. `model_kwargs` override those
    defaults (e.g. {"dtype": "float16"}). Liger kernels are used only when asked for and installed.
    """
    from transformers import AutoModelForCausalLM

    name = resolve_model_path(model_name)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    kwargs: dict[str, Any] = {
        "dtype": default_dtype(device),
        "attn_implementation": default_attn_implementation(device),
    }
    kwargs.update(model_kwargs or {})
    if "torch_dtype" in kwargs:  # transformers 5 renamed torch_dtype -> dtype
        kwargs["dtype"] = kwargs.pop("torch_dtype")

    loader = AutoModelForCausalLM
    if use_liger:
        if importlib.util.find_spec("liger_kernel") is None:
            warnings.warn(
                "use_liger=True but liger-kernel is not installed; loading without Liger kernels", stacklevel=2
            )
        else:
            from liger_kernel.transformers import AutoLigerKernelForCausalLM

            loader = AutoLigerKernelForCausalLM
    try:
        return loader.from_pretrained(name, **kwargs)
    except OSError as e:
        if name == model_name and not os.path.exists(name):
            raise _hub_error(name, e) from e
        raise


def get_tokenizer(model_name: str):
    from transformers import AutoTokenizer

    name = resolve_model_path(model_name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except OSError as e:
        if not os.path.exists(name):
            raise _hub_error(name, e) from e
        raise
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"tokenizer of {model_name!r} has no chat template; verifiers environments need chat models "
            "(set tokenizer.chat_template or use an instruct checkpoint)"
        )
    return tokenizer


def ensure_pad_token(tokenizer, model=None) -> bool:
    """Give `tokenizer` a pad token distinct from eos; resize `model` if one had to be added.

    Returns True when a new token was added to the vocabulary.
    """
    added = False
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        vocab = tokenizer.get_vocab()
        existing = next((c for c in _PAD_CANDIDATES if c in vocab and c != tokenizer.eos_token), None)
        if existing is not None:
            tokenizer.pad_token = existing
        else:
            tokenizer.add_special_tokens({"pad_token": _ADDED_PAD})
            added = True
            logger.warning("tokenizer had no pad token distinct from eos; added %s", _ADDED_PAD)
            if model is not None and len(tokenizer) > model.get_input_embeddings().num_embeddings:
                model.resize_token_embeddings(len(tokenizer))
    if model is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.pad_token_id = tokenizer.pad_token_id
    return added


def get_model_and_tokenizer(
    model_name: str,
    use_liger: bool = False,
    model_kwargs: dict[str, Any] | None = None,
    *,
    device: str | None = None,
):
    """(model, tokenizer) with a pad token that does not alias eos."""
    tokenizer = get_tokenizer(model_name)
    model = get_model(model_name, use_liger=use_liger, model_kwargs=model_kwargs, device=device)
    ensure_pad_token(tokenizer, model)
    return model, tokenizer

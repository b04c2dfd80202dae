"""Names from older verifiers trainers (`GRPOConfig`, verifiers <= 0.1.6) that users' scripts still pass.

A renamed field is translated, with a DeprecationWarning that names its replacement; a field with no
equivalent is refused with a line that says what replaced it. Nothing is silently ignored.

transformers 5.2x renamed `gradient_checkpointing` to `activation_checkpointing` and warns (FutureWarning) on the
old name. Scripts and configs written for verifiers and TRL use the old name, so it is taken as the new one
without a warning: the user has nothing to fix until transformers drops it.
"""

from __future__ import annotations

import functools
import warnings

# old name -> new RLConfig field (same meaning)
RENAMED = {
    "num_generations": "rollouts_per_example",
    "max_prompt_length": "max_prompt_len",
    "max_completion_length": "max_tokens",
    "async_generation_timeout": "generation_timeout",
    "num_batches_ahead": "max_async_level",
    "generation_batch_size": "batch_size",
    "beta": "kl_beta",
    "num_completions_to_print": "num_completions_to_log",
}

# transformers' old name -> its new one (same TrainingArguments field), translated silently
TRANSFORMERS_RENAMED = {
    "gradient_checkpointing": "activation_checkpointing",
    "gradient_checkpointing_kwargs": "activation_checkpointing_kwargs",
}

# old name -> what to do instead (no RLConfig field means the same thing)
REMOVED = {
    "model_init_kwargs": "load the model yourself (vf.get_model(name, model_kwargs=...)) and pass it as `model`",
    "disable_dropout": "set lora_dropout=0.0 (the default) or the model's dropout in its config",
    "ds3_gather_for_generation": "not needed: weights reach the server through the weight sync after every step",
    "steps_per_generation": "one rollout batch per optimizer step; use batch_size for the rollouts per step",
    "max_data_workers": "not needed: rollouts run on the orchestrator's event loop (max_concurrent bounds them)",
    "async_max_queue_size": "use max_async_level (batches generated ahead of training)",
    "vllm_guided_decoding_regex": "pass guided decoding through sampling_args={'extra_body': {...}}",
    "delta": "use loss_type='grpo' with epsilon / epsilon_high for clipping",
    "sync_ref_model": "the reference policy is the base model with its adapter disabled (kl_beta > 0 needs use_lora)",
    "ref_model_mixup_alpha": "the reference policy is the base model with its adapter disabled",
    "ref_model_sync_steps": "the reference policy is the base model with its adapter disabled",
    "wandb_log_unique_prompts": "num_completions_to_log rows are logged per step (report_to='wandb')",
}


def translate_legacy_kwargs(kwargs: dict, owner: str = "RLConfig") -> dict:
    """Map renamed keywords (warning once each) and refuse removed ones with a one-line ValueError."""
    removed = [k for k in kwargs if k in REMOVED]
    if removed:
        raise ValueError(f"invalid {owner}: " + "; ".join(f"{k} is no longer supported: {REMOVED[k]}" for k in removed))
    out = dict(kwargs)
    for old, new in RENAMED.items():
        if old not in out:
            continue
        if new in out:
            raise ValueError(f"invalid {owner}: pass {new} only ({old} is its old name)")
        warnings.warn(f"{owner}({old}=...) is deprecated; use {new}=...", DeprecationWarning, stacklevel=4)
        out[new] = out.pop(old)
    for old, new in TRANSFORMERS_RENAMED.items():
        value = out.pop(old, None)
        if value is None:
            continue
        if out.get(new) is not None and out[new] != value:  # a copy of resolved args holds both, equal
            raise ValueError(f"invalid {owner}: {old}={value!r} contradicts {new}={out[new]!r} (pass {new} only)")
        out[new] = value
    if "scale_rewards" in out and isinstance(out["scale_rewards"], bool):
        # GRPOConfig's scale_rewards was a bool: True = divide by the group std
        warnings.warn("scale_rewards=True/False is deprecated; use 'group' or 'none'", DeprecationWarning, stacklevel=4)
        out["scale_rewards"] = "group" if out["scale_rewards"] else "none"
    return out


def accept_legacy_names(init):
    """RLConfig(**kwargs) with names from older trainers: renamed ones translated, removed ones refused, and the
    HF batch fields that RLConfig replaces flagged instead of silently overwritten."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        owner = type(self).__name__
        kwargs = translate_legacy_kwargs(kwargs, owner)
        for name, instead in (
            ("per_device_train_batch_size", "micro_batch_size (samples per forward/backward pass)"),
            ("gradient_accumulation_steps", "batch_size (rollouts per optimizer step)"),
        ):
            if kwargs.pop(name, 1) != 1:
                warnings.warn(f"{owner}({name}=...) is ignored: set {instead}", UserWarning, stacklevel=2)
        init(self, *args, **kwargs)
        self.__dict__["given_fields"] = tuple(kwargs)  # what the user set (the model card lists those); not a field
        if unused := lora_without_lora(kwargs):
            warnings.warn(f"{owner}: use_lora=False (full fine-tuning): {unused} is ignored", UserWarning, stacklevel=2)

    return __init__


def lora_without_lora(given: dict) -> str:
    """The LoRA settings a run without LoRA was given ("" when none): they do nothing, which a user should hear."""
    if given.get("use_lora", True) is not False:
        return ""
    return ", ".join(sorted(k for k in given if k.startswith("lora_")))

"""One LoRA configuration builder and one set of defaults, shared by RLConfig, vf-sft and the old
`lora_defaults()` helper."""

from __future__ import annotations

import contextlib
import warnings

# all attention and MLP projections of Llama/Qwen-style decoders (what peft's "all-linear" picks there)
DEFAULT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_RANK = 8
LORA_ALPHA = 32
LORA_DROPOUT = 0.0


def lora_config(
    rank: int = LORA_RANK,
    alpha: float = LORA_ALPHA,
    dropout: float = LORA_DROPOUT,
    target_modules: list[str] | str | None = None,
    modules_to_save: list[str] | None = None,
    use_rslora: bool = False,
):
    """A peft LoraConfig for a causal LM; `target_modules` None means DEFAULT_LORA_TARGETS."""
    from peft import LoraConfig

    return LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(DEFAULT_LORA_TARGETS) if target_modules is None else target_modules,
        modules_to_save=modules_to_save,
        use_rslora=use_rslora,
        task_type="CAUSAL_LM",
    )


@contextlib.contextmanager
def quiet_peft_wrap():
    """peft (0.21) reads transformers' deprecated `is_gradient_checkpointing` property whenever it wraps a model,
    and transformers 5.2x warns (FutureWarning) on every read. The warning is about peft's code, not the user's:
    it is filtered here, that message only, around peft's own calls."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def wrap_lora(model, config):
    """`peft.get_peft_model` without peft's deprecation noise."""
    from peft import get_peft_model

    with quiet_peft_wrap():
        return get_peft_model(model, config)


def run_lora_config(args):
    """The run's LoraConfig: `args.lora_config` as given, else built from the lora_* fields."""
    return args.lora_config or lora_config(
        args.lora_rank,
        args.lora_alpha,
        args.lora_dropout,
        args.lora_target_modules,
        args.lora_modules_to_save,
        args.lora_use_rslora,
    )


def lora_ranks(args) -> int:
    """The largest LoRA rank the run trains (its config's r, or a larger one in its rank pattern)."""
    config = args.lora_config
    rank = config.r if config is not None else args.lora_rank
    pattern = (getattr(config, "rank_pattern", None) or {}) if config is not None else {}
    return max([int(rank), *map(int, pattern.values())])

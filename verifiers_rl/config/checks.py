"""The rules RLConfig's fields must satisfy (every violation named, with what is allowed), and the request
fields (`sampling_args`) that follow from them.

Pure functions over the config object, so `vf-rl --dry-run` and `RLConfig(...)` say the same thing.
"""

from __future__ import annotations

import math
from typing import Any

from verifiers_rl.config.choices import ENGINES, LORA_SYNC, SERVER_MODES, SYNC_BACKENDS, LoraSync

LOSS_TYPES = ("is", "grpo", "dapo", "dr_grpo", "gspo", "cispo")
SCALE_REWARDS = ("group", "batch", "none")
FINAL_MODELS = ("merged+adapter", "merged", "adapter", "none")  # what train() writes to <output_dir>/final
SETTINGS_CHANGES = ("stop", "continue", "restart")  # a rerun whose checkpoint was trained otherwise (run_settings.py)
# the wandb.init arguments a config may set ([trainer.args.wandb]): plain data, the ones wandb users write
WANDB_KEYS = ("project", "name", "entity", "tags", "group", "notes", "job_type", "mode", "dir")

# sampling_args keys that are RLConfig fields: a user's sampling_args sets the field, so the trainer scores
# with exactly what the server samples with (temperature above all)
_TOP_LEVEL_FIELDS = ("temperature", "top_p", "max_tokens", "presence_penalty", "frequency_penalty")
_EXTRA_BODY_FIELDS = ("top_k", "min_p", "repetition_penalty")
SAMPLING_FIELDS = (*_TOP_LEVEL_FIELDS, *_EXTRA_BODY_FIELDS)  # RLConfig fields that sampling_args also holds


def effective_sampling_args(cfg, user: dict[str, Any] | None) -> dict[str, Any]:
    """The request fields the orchestrator sends (verifiers 0.1.14 sampling_args), after `user`'s overrides."""
    user = dict(user or {})
    extra_user = dict(user.pop("extra_body", None) or {})
    for key in _TOP_LEVEL_FIELDS:
        if key in user:
            setattr(cfg, key, user.pop(key))
    for key in _EXTRA_BODY_FIELDS:
        if key in extra_user:
            setattr(cfg, key, extra_user.pop(key))
        elif key in user:
            setattr(cfg, key, user.pop(key))
    if user.get("n", 1) != 1:
        raise ValueError(
            f"invalid RLConfig: sampling_args n={user['n']}: each request is one rollout; set rollouts_per_example"
        )
    if user.get("logprobs", True) is not True:
        raise ValueError("invalid RLConfig: sampling_args logprobs=False: the trainer needs the sampler's logprobs")
    user.pop("n", None)
    user.pop("logprobs", None)
    # Every field that shapes the distribution goes out, defaults included: a server fills a field the request
    # leaves out from the checkpoint's generation_config.json (vLLM does, unless started with
    # `--generation-config vllm`; Qwen3 ships top_k 20, top_p 0.95, temperature 0.6), and the trainer scores the
    # distribution these fields state.
    args: dict[str, Any] = {
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "presence_penalty": cfg.presence_penalty or 0.0,
        "frequency_penalty": cfg.frequency_penalty or 0.0,
        "logprobs": True,
    }
    if cfg.max_tokens is not None:
        args["max_tokens"] = cfg.max_tokens
    extra: dict[str, Any] = {
        **extra_user,
        "return_token_ids": True,
        "top_k": -1 if cfg.top_k is None else cfg.top_k,  # -1: off, in vLLM and the CPU engine alike
        "min_p": cfg.min_p or 0.0,
        "repetition_penalty": cfg.repetition_penalty,
    }
    args.update(user)  # anything else the user asked for (e.g. stop) goes out as given
    args["extra_body"] = extra
    return args


def describe_sampling(sampling_args: dict[str, Any]) -> str:
    """The distribution every rollout request states, as one line (`vf-rl --dry-run`'s `# sampling`)."""
    fields = {**{k: v for k, v in sampling_args.items() if k != "extra_body"}, **sampling_args.get("extra_body", {})}
    shown = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
    return " ".join(f"{k}={fields[k]}" for k in (*shown, "max_tokens") if k in fields)


def check_config(cfg) -> list[str]:
    """Every rule a field breaks, as `name=value: rule` lines."""
    errors: list[str] = []

    def check(ok: bool, name: str, rule: str):
        if not ok:
            errors.append(f"{name}={getattr(cfg, name)!r}: {rule}")

    for name, choices in (
        ("loss_type", LOSS_TYPES),
        ("scale_rewards", SCALE_REWARDS),
        ("lora_sync", LORA_SYNC),
        ("server_mode", SERVER_MODES),
        ("server_engine", ENGINES),
        ("sync_backend", SYNC_BACKENDS),
        ("overlong_policy", ("truncate", "drop")),
        ("final_model", FINAL_MODELS),
        ("on_settings_change", SETTINGS_CHANGES),
    ):
        check(getattr(cfg, name) in choices, name, f"allowed: {', '.join(choices)}")
    unknown = sorted(set(cfg.wandb or {}) - set(WANDB_KEYS))
    check(not unknown, "wandb", f"unknown key(s) {', '.join(unknown)}; allowed: {', '.join(WANDB_KEYS)}")
    _batch_rules(cfg, check)
    _length_rules(cfg, check)
    _loss_and_lora_rules(cfg, check)
    return errors


def _batch_rules(cfg, check) -> None:
    check(cfg.rollouts_per_example >= 2, "rollouts_per_example", "must be >= 2 (advantages are relative to the group)")
    check(
        cfg.batch_size >= 1 and cfg.batch_size % max(cfg.rollouts_per_example, 1) == 0,
        "batch_size",
        f"must be a positive multiple of rollouts_per_example={cfg.rollouts_per_example}",
    )
    check(cfg.micro_batch_size >= 1, "micro_batch_size", "must be >= 1")
    check(cfg.temperature > 0, "temperature", "must be > 0 (the trainer divides logits by it)")
    check(cfg.eval_temperature is None or cfg.eval_temperature >= 0, "eval_temperature", "must be >= 0 (0: greedy)")
    check(0 < cfg.top_p <= 1, "top_p", "must be in (0, 1]")
    check(cfg.top_k is None or cfg.top_k == -1 or cfg.top_k > 0, "top_k", "must be None, -1 or > 0")
    check(cfg.min_p is None or 0 <= cfg.min_p <= 1, "min_p", "must be in [0, 1]")
    check(cfg.max_steps >= 1, "max_steps", "must be >= 1")
    check(cfg.max_async_level >= 0, "max_async_level", "must be >= 0")
    check(cfg.num_iterations >= 1, "num_iterations", "must be >= 1 (optimizer steps per rollout batch)")
    check(cfg.oversampling_factor >= 1, "oversampling_factor", "must be >= 1 (prompts drawn per batch / needed)")
    check(cfg.max_concurrent >= 1, "max_concurrent", "must be >= 1")
    check(cfg.max_empty_steps >= 1, "max_empty_steps", "must be >= 1")
    check(cfg.sync_bucket_mb >= 1, "sync_bucket_mb", "must be >= 1")
    check(cfg.mismatch_kl_guard >= 0, "mismatch_kl_guard", "must be >= 0 (0 turns the check off)")
    check(cfg.mismatch_kl_floor >= 0, "mismatch_kl_floor", "must be >= 0")
    check(cfg.generation_timeout > 0, "generation_timeout", "must be > 0")
    check(cfg.scoring_timeout > 0, "scoring_timeout", "must be > 0")
    check(cfg.server_restarts >= 0, "server_restarts", "must be >= 0")
    check(cfg.server_restart_grace >= 0, "server_restart_grace", "must be >= 0")
    check(cfg.eval_rollouts_per_example >= 1, "eval_rollouts_per_example", "must be >= 1")
    port = cfg.vllm_server_port
    check(port is None or 0 < port < 65536, "vllm_server_port", "must be a TCP port in 1..65535")


def _length_rules(cfg, check) -> None:
    check(cfg.max_seq_len >= 2, "max_seq_len", "must be >= 2")
    check(cfg.max_tokens is None or cfg.max_tokens >= 1, "max_tokens", "must be None or >= 1")
    limit = cfg.server_max_model_len or cfg.max_seq_len
    check(
        cfg.max_tokens is None or cfg.max_tokens < limit,
        "max_tokens",
        f"leaves no room for a prompt in the server's context of {limit} tokens "
        f"({'server_max_model_len' if cfg.server_max_model_len else 'max_seq_len'}); lower max_tokens or raise it",
    )
    check(
        cfg.max_prompt_len is None or cfg.max_prompt_len < cfg.max_seq_len,
        "max_prompt_len",
        f"must be None or < max_seq_len={cfg.max_seq_len}",
    )
    check(
        cfg.max_prompt_len is None or cfg.max_tokens is None or cfg.max_prompt_len + cfg.max_tokens <= limit,
        "max_prompt_len",
        f"plus max_tokens={cfg.max_tokens} exceeds the server's context of {limit} tokens: the server would reject "
        "those requests; lower one of them or raise max_seq_len / server_max_model_len",
    )


def _loss_and_lora_rules(cfg, check) -> None:
    check(
        0 < cfg.mask_ratio_low < 1 < cfg.mask_ratio_high,
        "mask_ratio_low",
        f"need 0 < mask_ratio_low < 1 < mask_ratio_high (mask_ratio_high={cfg.mask_ratio_high})",
    )
    check(cfg.kl_beta >= 0, "kl_beta", "must be >= 0")
    check(
        cfg.kl_beta == 0 or cfg.use_lora,
        "kl_beta",
        "needs use_lora=True (the reference policy is the model with its adapter disabled)",
    )
    check(cfg.lora_sync != LoraSync.ADAPTER or cfg.use_lora, "lora_sync", "'adapter' needs use_lora=True")
    check(
        cfg.lora_sync != LoraSync.ADAPTER or not cfg.lora_modules_to_save,
        "lora_sync",
        "'adapter' sends LoRA A/B only: it cannot carry lora_modules_to_save (use lora_sync='merged')",
    )
    check(cfg.lora_rank >= 1, "lora_rank", "must be >= 1")
    check(cfg.final_model != "adapter" or cfg.use_lora, "final_model", "'adapter' needs use_lora=True")
    check(
        cfg.final_model != "none" or not cfg.push_to_hub,
        "final_model",
        "'none' leaves push_to_hub nothing to push (push_to_hub pushes <output_dir>/final)",
    )
    check(
        cfg.lora_config is None or type(cfg.lora_config).__name__ == "LoraConfig",
        "lora_config",
        "must be a peft.LoraConfig (or None to build one from the lora_* fields)",
    )


def uneven_split(batch_size: int, micro_batch_size: int, processes: int, who: str = "processes") -> str | None:
    """The rule's one home: one step's batch splits into whole micro-batches on every training process. RLConfig
    checks it for the processes it runs in, vf-rl's plan for those it will start (`who` names them); each caller
    says which key it was (None: it splits)."""
    if micro_batch_size < 1 or batch_size % (micro_batch_size * processes) == 0:  # micro_batch_size < 1: its own rule
        return None
    return f"must be divisible by micro_batch_size * {who} = {micro_batch_size} * {processes}"


def check_ratios(ratios, names: list[str], where=lambda i: f"env[{i}].ratio") -> list[float]:
    """Ratios are finite numbers >= 0 that sum to something positive; errors name the entry."""
    ratios = list(ratios)
    if len(ratios) != len(names):
        raise ValueError(f"{len(ratios)} ratios for {len(names)} environments ({', '.join(names)})")
    for i, r in enumerate(ratios):
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r < 0:
            raise ValueError(f"{where(i)}={r!r}: a sampling ratio is a number >= 0")
    if sum(ratios) <= 0:
        raise ValueError(
            f"{', '.join(f'{where(i)}={r!r}' for i, r in enumerate(ratios))}: the ratios sum to 0; "
            "give at least one environment a positive ratio"
        )
    return [float(r) for r in ratios]

"""RLConfig: `TrainingArguments` plus everything an RL run needs. Every field does what its name says;
`tests/test_config.py` walks them and docs/configuration.md is generated from this file."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from verifiers_rl.rl.inference.layout import ENGINES, SYNC_BACKENDS
from verifiers_rl.rl.trainer.lora import DEFAULT_LORA_TARGETS, LORA_ALPHA, LORA_DROPOUT, LORA_RANK
from verifiers_rl.rl.trainer.losses import LOSS_TYPES

SCALE_REWARDS = ("group", "batch", "none")
LORA_SYNC = ("merged", "adapter")
SERVER_MODES = ("spawn", "connect")


def _help(text: str) -> dict[str, Any]:
    return {"help": text}


@dataclass
class RLConfig(TrainingArguments):
    # ---------------------------------------------------------------- LoRA
    use_lora: bool = field(default=True, metadata=_help("Train a LoRA adapter (peft) instead of all weights."))
    lora_rank: int = field(default=LORA_RANK, metadata=_help("LoRA rank r."))
    lora_alpha: int = field(
        default=LORA_ALPHA, metadata=_help("LoRA alpha; the update is scaled by alpha/r (alpha/sqrt(r) with rsLoRA).")
    )
    lora_dropout: float = field(default=LORA_DROPOUT, metadata=_help("Dropout on the LoRA input."))
    lora_target_modules: list[str] | str | None = field(
        default=None,
        metadata=_help("Modules that get LoRA (names or 'all-linear'); default: all attention and MLP projections."),
    )
    lora_modules_to_save: list[str] | None = field(
        default=None, metadata=_help("Modules trained in full next to the adapter (e.g. ['lm_head']).")
    )
    lora_use_rslora: bool = field(default=False, metadata=_help("Rank-stabilised LoRA scaling alpha/sqrt(r)."))

    # ---------------------------------------------------------------- batch
    rollouts_per_example: int = field(
        default=16, metadata=_help("Rollouts per prompt: the group size for group-relative advantages.")
    )
    batch_size: int = field(
        default=512,
        metadata=_help("Rollouts per optimizer step (prompts per step = batch_size / rollouts_per_example)."),
    )
    micro_batch_size: int = field(
        default=8, metadata=_help("Most training samples in one forward/backward pass per process.")
    )
    micro_batch_tokens: int | None = field(
        default=None,
        metadata=_help(
            "Token budget of one micro-batch (padded or packed tokens); default micro_batch_size * max_seq_len."
        ),
    )
    pack_sequences: bool = field(
        default=True,
        metadata=_help("Padding-free packing of micro-batches (block-diagonal attention from position_ids)."),
    )
    max_seq_len: int = field(
        default=2048,
        metadata=_help(
            "Longest training sample (prompt + completion tokens); longer ones are handled per overlong_policy."
        ),
    )
    overlong_policy: str = field(
        default="truncate",
        metadata=_help("Samples over max_seq_len: 'truncate' (cut the tail, train the rest) or 'drop'."),
    )
    max_prompt_len: int | None = field(
        default=None,
        metadata=_help(
            "Prompts longer than this (tokens, chat template applied) are filtered out of the dataset once, "
            "and counted; None: max_seq_len - 1."
        ),
    )
    max_steps: int = field(default=500, metadata=_help("Optimizer steps to train for."))
    max_concurrent: int = field(default=1024, metadata=_help("Most rollouts in flight at once against the server."))
    max_async_level: int = field(
        default=1,
        metadata=_help(
            "Rollout batches generated ahead of training "
            "(0 = on-policy; k lets step n train while batch n+k generates)."
        ),
    )
    shuffle_dataset: bool = field(
        default=True, metadata=_help("Shuffle the training dataset (seeded by `seed`, reshuffled each pass).")
    )

    # ---------------------------------------------------------------- loss
    loss_type: str = field(
        default="is",
        metadata=_help(
            "'is' (importance-ratio PG against the sampler's logprobs, tokens masked outside "
            "[mask_ratio_low, mask_ratio_high]), 'grpo', 'dapo', 'dr_grpo', 'gspo', 'cispo'."
        ),
    )
    mask_ratio_low: float = field(
        default=0.125, metadata=_help("'is' loss: tokens with trainer/sampler probability ratio below this are masked.")
    )
    mask_ratio_high: float = field(default=8.0, metadata=_help("'is' loss: tokens with ratio above this are masked."))
    epsilon: float = field(default=0.2, metadata=_help("Clip range below 1 (grpo/dapo/dr_grpo/gspo)."))
    epsilon_high: float | None = field(
        default=None,
        metadata=_help("Clip range above 1; default: epsilon (dapo: 0.28; gspo: 4e-4 with epsilon 3e-4; cispo: 5.0)."),
    )
    scale_rewards: str = field(
        default="group",
        metadata=_help("Advantage scaling: 'group' (divide by group std), 'batch' (batch std) or 'none'."),
    )
    kl_beta: float = field(
        default=0.0,
        metadata=_help("KL penalty to the reference policy (the base model, adapter disabled); 0 = no reference pass."),
    )
    mask_env_responses: bool = field(
        default=True, metadata=_help("Do not train on environment/tool tokens of multi-turn rollouts.")
    )
    mask_truncated_completions: bool = field(
        default=False, metadata=_help("Do not train on rollouts cut off by max_tokens (DAPO's overlong filtering).")
    )
    zero_truncated_completions: bool = field(
        default=False, metadata=_help("Give truncated rollouts reward 0 (before advantages).")
    )

    # ---------------------------------------------------------------- sampling
    max_tokens: int | None = field(
        default=None, metadata=_help("Most tokens generated per turn (None: up to the context limit).")
    )
    temperature: float = field(
        default=1.0, metadata=_help("Sampling temperature (> 0); the trainer scores with the same temperature.")
    )
    top_p: float = field(default=1.0, metadata=_help("Nucleus sampling mass in (0, 1]."))
    top_k: int | None = field(default=None, metadata=_help("Keep the k most likely tokens (None: off)."))
    min_p: float | None = field(
        default=0.0, metadata=_help("Drop tokens below min_p times the top token's probability.")
    )
    repetition_penalty: float = field(
        default=1.0, metadata=_help("> 1 discourages tokens already in the prompt or completion.")
    )
    presence_penalty: float = field(
        default=0.0, metadata=_help("Subtracted once from logits of tokens already generated.")
    )
    frequency_penalty: float = field(
        default=0.0, metadata=_help("Subtracted per occurrence from logits of generated tokens.")
    )
    generation_timeout: float = field(
        default=600.0, metadata=_help("Seconds one rollout batch may take before training stops with an error.")
    )

    # ---------------------------------------------------------------- inference server
    server_mode: str = field(
        default="spawn",
        metadata=_help("'spawn' a server the trainer owns, or 'connect' to one at vllm_server_host:port."),
    )
    server_engine: str = field(
        default="auto", metadata=_help("Engine of a spawned server: 'auto' (vLLM if CUDA, else CPU), 'cpu', 'vllm'.")
    )
    server_gpus: list[int] | None = field(
        default=None, metadata=_help("CUDA devices of a spawned server (CUDA_VISIBLE_DEVICES).")
    )
    server_args: list[str] | None = field(
        default=None, metadata=_help("Extra flags for a spawned server (vLLM flags pass through).")
    )
    server_max_model_len: int | None = field(
        default=None, metadata=_help("Context limit of a spawned server; default max_seq_len.")
    )
    vllm_server_host: str = field(
        default="127.0.0.1", metadata=_help("Server host (spawn: bind address; connect: where it runs).")
    )
    vllm_server_port: int | None = field(
        default=None, metadata=_help("Server port; None: a free port (spawn) / 8000 (connect).")
    )
    vllm_server_timeout: float = field(
        default=300.0, metadata=_help("Seconds to wait for the server to become healthy.")
    )
    server_control_token: str | None = field(
        default=None, metadata=_help("connect mode: control token of the server (default: $VF_CONTROL_TOKEN).")
    )

    # ---------------------------------------------------------------- weight sync
    sync_backend: str = field(
        default="auto", metadata=_help("'gloo' (CPU), 'nccl' (GPU, trainer and server on different GPUs) or 'auto'.")
    )
    sync_bucket_mb: int = field(default=64, metadata=_help("Bucket size of a weight sync in MiB."))
    lora_sync: str = field(
        default="merged",
        metadata=_help("'merged' (send base+delta) or 'adapter' (send only LoRA A/B; CPU engine only)."),
    )

    # ---------------------------------------------------------------- logging / eval
    num_eval_examples: int | None = field(
        default=None, metadata=_help("Eval examples used by evaluate() (None: the whole eval split).")
    )
    eval_rollouts_per_example: int = field(default=1, metadata=_help("Rollouts per eval example."))
    log_completions: bool = field(
        default=True, metadata=_help("Show a sample prompt/completion/reward every logging_steps (and a wandb table).")
    )
    num_completions_to_log: int = field(default=8, metadata=_help("Rows of the completions table per logged step."))

    # ---------------------------------------------------------------- TrainingArguments defaults that fit RL
    learning_rate: float = field(default=1e-5, metadata=_help("AdamW learning rate."))
    lr_scheduler_type: str = field(default="constant", metadata=_help("Learning-rate schedule."))
    logging_steps: float = field(default=1, metadata=_help("Log every N steps."))
    max_grad_norm: float = field(default=1.0, metadata=_help("Gradient clipping norm."))
    report_to: str | list[str] | None = field(default="none", metadata=_help("'wandb', 'tensorboard', ... or 'none'."))
    save_strategy: str = field(default="steps", metadata=_help("When to checkpoint."))
    save_steps: float = field(default=50, metadata=_help("Checkpoint every N steps."))
    remove_unused_columns: bool = field(default=False, metadata=_help("Keep dataset columns (environments need them)."))

    def __post_init__(self):
        if self.output_dir is None:
            self.output_dir = os.path.join("outputs", self.run_name or "vf-rl")
        errors: list[str] = []

        def check(ok: bool, name: str, rule: str):
            if not ok:
                errors.append(f"{name}={getattr(self, name)!r}: {rule}")

        check(self.loss_type in LOSS_TYPES, "loss_type", f"allowed: {', '.join(LOSS_TYPES)}")
        check(self.scale_rewards in SCALE_REWARDS, "scale_rewards", f"allowed: {', '.join(SCALE_REWARDS)}")
        check(self.lora_sync in LORA_SYNC, "lora_sync", f"allowed: {', '.join(LORA_SYNC)}")
        check(self.server_mode in SERVER_MODES, "server_mode", f"allowed: {', '.join(SERVER_MODES)}")
        check(self.server_engine in ENGINES, "server_engine", f"allowed: {', '.join(ENGINES)}")
        check(self.sync_backend in SYNC_BACKENDS, "sync_backend", f"allowed: {', '.join(SYNC_BACKENDS)}")
        check(self.overlong_policy in ("truncate", "drop"), "overlong_policy", "allowed: truncate, drop")
        check(
            self.rollouts_per_example >= 2,
            "rollouts_per_example",
            "must be >= 2 (advantages are relative to the group)",
        )
        check(
            self.batch_size >= 1 and self.batch_size % max(self.rollouts_per_example, 1) == 0,
            "batch_size",
            f"must be a positive multiple of rollouts_per_example={self.rollouts_per_example}",
        )
        check(self.micro_batch_size >= 1, "micro_batch_size", "must be >= 1")
        check(self.temperature > 0, "temperature", "must be > 0 (the trainer divides logits by it)")
        check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(self.top_k is None or self.top_k == -1 or self.top_k > 0, "top_k", "must be None, -1 or > 0")
        check(self.min_p is None or 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        check(self.max_steps >= 1, "max_steps", "must be >= 1")
        check(self.max_seq_len >= 2, "max_seq_len", "must be >= 2")
        check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be None or >= 1")
        check(
            self.max_prompt_len is None or self.max_prompt_len < self.max_seq_len,
            "max_prompt_len",
            f"must be None or < max_seq_len={self.max_seq_len}",
        )
        check(self.max_async_level >= 0, "max_async_level", "must be >= 0")
        check(self.max_concurrent >= 1, "max_concurrent", "must be >= 1")
        check(
            0 < self.mask_ratio_low < 1 < self.mask_ratio_high,
            "mask_ratio_low",
            f"need 0 < mask_ratio_low < 1 < mask_ratio_high (mask_ratio_high={self.mask_ratio_high})",
        )
        check(self.kl_beta >= 0, "kl_beta", "must be >= 0")
        check(
            self.kl_beta == 0 or self.use_lora,
            "kl_beta",
            "needs use_lora=True (the reference policy is the model with its adapter disabled)",
        )
        check(self.lora_sync == "merged" or self.use_lora, "lora_sync", "'adapter' needs use_lora=True")
        check(self.lora_rank >= 1, "lora_rank", "must be >= 1")
        check(self.sync_bucket_mb >= 1, "sync_bucket_mb", "must be >= 1")
        check(self.generation_timeout > 0, "generation_timeout", "must be > 0")
        check(self.eval_rollouts_per_example >= 1, "eval_rollouts_per_example", "must be >= 1")
        if errors:
            raise ValueError("invalid RLConfig: " + "; ".join(errors))
        if self.epsilon_high is None:
            self.epsilon_high = {"dapo": 0.28, "cispo": 5.0}.get(self.loss_type, self.epsilon)
        if self.lora_target_modules is None:
            self.lora_target_modules = list(DEFAULT_LORA_TARGETS)
        # One optimizer step per rollout batch: the trainer runs its own micro-batches inside training_step.
        self.per_device_train_batch_size = 1
        self.gradient_accumulation_steps = 1
        super().__post_init__()
        world = max(self.world_size, 1)
        if self.batch_size % (self.micro_batch_size * world) != 0:
            raise ValueError(
                f"invalid RLConfig: batch_size={self.batch_size}: must be divisible by micro_batch_size * processes "
                f"= {self.micro_batch_size} * {world}"
            )

    @property
    def prompts_per_batch(self) -> int:
        return self.batch_size // self.rollouts_per_example

    @property
    def prompt_limit(self) -> int:
        return self.max_prompt_len if self.max_prompt_len is not None else self.max_seq_len - 1

    @property
    def token_budget(self) -> int:
        return self.micro_batch_tokens or self.micro_batch_size * self.max_seq_len

    def sampling_args(self) -> dict[str, Any]:
        """What the orchestrator sends with every request (verifiers 0.1.14 sampling_args)."""
        args: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "logprobs": True,
            "extra_body": {"return_token_ids": True},
        }
        if self.max_tokens is not None:
            args["max_tokens"] = self.max_tokens
        extra = args["extra_body"]
        if self.top_k not in (None, -1):
            extra["top_k"] = self.top_k
        if self.min_p:
            extra["min_p"] = self.min_p
        if self.repetition_penalty != 1.0:
            extra["repetition_penalty"] = self.repetition_penalty
        if self.presence_penalty:
            args["presence_penalty"] = self.presence_penalty
        if self.frequency_penalty:
            args["frequency_penalty"] = self.frequency_penalty
        return args

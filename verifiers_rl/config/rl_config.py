"""RLConfig: `TrainingArguments` plus everything an RL run needs. Every field does what its name says;
`tests/unit/test_config.py` walks them and docs/configuration.md is generated from this file. The rules that
fields must satisfy live in `checks.py`; names from older trainers are translated in `legacy.py`."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from verifiers_rl.config.checks import SAMPLING_FIELDS, check_config, effective_sampling_args, uneven_split
from verifiers_rl.config.hf_compat import TrainingArguments
from verifiers_rl.config.legacy import TRANSFORMERS_RENAMED, accept_legacy_names
from verifiers_rl.config.limits import room_for_prompt
from verifiers_rl.config.lora import DEFAULT_LORA_TARGETS, LORA_ALPHA, LORA_DROPOUT, LORA_RANK
from verifiers_rl.config.net import DEFAULT_PORT, LOOPBACK
from verifiers_rl.config.sharding import follow_launcher_precision


def _help(text: str, toml: str | None = None) -> dict[str, Any]:
    """Field metadata: its help line, and `toml`, the key that spells the same setting in a vf-rl TOML file outside
    [trainer.args] (one setting, one home: both spellings fold into this field, `toml_config.fold_aliases`)."""
    return {"help": text, "toml": toml} if toml else {"help": text}


@dataclass
class RLConfig(TrainingArguments):
    # ---------------------------------------------------------------- LoRA
    use_lora: bool = field(default=True, metadata=_help("Train a LoRA adapter (peft) instead of all weights."))
    lora_config: Any = field(
        default=None,
        metadata=_help("A peft LoraConfig used as is (wins over the lora_* fields, like RLTrainer(peft_config=...))."),
    )
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
    share_prompt_prefix: bool = field(
        default=True,
        metadata=_help(
            "Forward each group's shared prompt once per micro-batch, its rollouts attending to it (same loss and "
            "gradients); needs pack_sequences and SDPA or eager attention, and is used when it costs fewer FLOPs."
        ),
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
    rollout_process: bool = field(
        default=True,
        metadata=_help(
            "Run the environment's code (env_response, reward functions, the HTTP client) in a child process, off the "
            "trainer's GIL; an environment that cannot be copied into it (dill) generates in the trainer's process."
        ),
    )
    num_iterations: int = field(
        default=1,
        metadata=_help(
            "Optimizer steps per rollout batch (TRL's num_iterations, PPO's epochs), each against the sampler's "
            "logprobs (the loss clips or masks); max_steps counts optimizer steps: max_steps / num_iterations batches "
            "are sampled."
        ),
    )
    shuffle_dataset: bool = field(
        default=True, metadata=_help("Shuffle the training dataset (seeded by `seed`, reshuffled each pass).")
    )
    online_difficulty_filtering: bool = field(
        default=False,
        metadata=_help(
            "Drop groups whose rollouts all got the same reward (they train nothing) and train the first "
            "prompts_per_batch informative groups of ceil(prompts_per_batch * oversampling_factor) drawn per batch."
        ),
    )
    oversampling_factor: float = field(
        default=1.0,
        metadata=_help(
            "Prompts drawn per batch over prompts_per_batch, with online_difficulty_filtering (the bound on extra "
            "generation; a batch with fewer informative groups trains fewer rollouts); without it, no effect."
        ),
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
        default=None,
        metadata=_help("Most tokens generated per turn (None: up to the context limit; upstream's tutorial set 512)."),
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
    sampling_args: dict | None = field(
        default=None,
        metadata=_help(
            "Extra request fields, merged over the ones built from the fields above (temperature, top_p, max_tokens, "
            "penalties and extra_body keys set the matching fields); after init, the effective request fields."
        ),
    )
    generation_timeout: float = field(
        default=600.0,
        metadata=_help(
            "Seconds one rollout batch may take before training stops with an error naming the stage it is stuck "
            "in (generation, env_response, scoring) and the function."
        ),
    )
    scoring_timeout: float = field(
        default=300.0,
        metadata=_help(
            "Seconds one reward-function call may run; a call still running after that stops training with the "
            "function's name (a judge that never answers is not the inference server's fault)."
        ),
    )

    # ---------------------------------------------------------------- inference server
    server_mode: str = field(
        default="auto",
        metadata=_help(
            "'auto': use the server that answers at vllm_server_host:port (8000 when unset) if it speaks the RL "
            "protocol, else spawn one; 'spawn': always start a server the trainer owns; 'connect': only connect."
        ),
    )
    server_engine: str = field(
        default="auto",
        metadata=_help(
            "Engine of a spawned server: 'auto' (vLLM if CUDA, else CPU), 'cpu', 'vllm'.", "inference.engine"
        ),
    )
    server_gpus: list[int] | None = field(
        default=None,
        metadata=_help(
            "GPUs of a spawned server, as indices of this process's visible GPUs (default: the first; the "
            "server's CUDA_VISIBLE_DEVICES is derived from them)."
        ),
    )
    server_args: list[str] | None = field(
        default=None,
        metadata=_help(
            "Extra flags for a spawned server (vLLM flags pass through); in TOML also [inference.args] as a table "
            "(gpu_memory_utilization = 0.8 -> --gpu-memory-utilization 0.8).",
            "inference.args",
        ),
    )
    server_max_model_len: int | None = field(
        default=None, metadata=_help("Context limit of a spawned server; default max_seq_len.")
    )
    vllm_server_host: str = field(
        default=LOOPBACK,
        metadata=_help("Server host (spawn: bind address; connect: where it runs).", "inference.host"),
    )
    vllm_server_port: int | None = field(
        default=None,
        metadata=_help(
            f"Server port; None: {DEFAULT_PORT} (connect, and where auto looks first) / a free port (spawn).",
            "inference.port",
        ),
    )
    server_api_key: str | None = field(
        default=None,
        metadata=_help("API key of the server's /v1 routes (vLLM's --api-key); default: $VLLM_API_KEY."),
    )
    vllm_server_timeout: float = field(
        default=600.0,
        metadata=_help(
            "Seconds to wait for the server to become healthy (a large model's first vLLM start compiles and "
            "captures graphs for minutes; a server that exits fails at once, whatever this says).",
            "inference.startup_timeout",
        ),
    )
    server_restarts: int = field(
        default=2,
        metadata=_help(
            "A spawned server that dies (the OOM killer, a CUDA fault, kill -9) is restarted up to this many times "
            "in a row, with backoff; the current weights are synced into it and the lost rollouts generated again. "
            "0: stop instead."
        ),
    )
    server_restart_grace: float = field(
        default=60.0,
        metadata=_help(
            "A server the trainer only connected to that stops answering is awaited this many seconds (up to "
            "server_restarts times in a row) before the run stops with the command that resumes it."
        ),
    )
    server_control_token: str | None = field(
        default=None, metadata=_help("connect mode: control token of the server (default: $VF_CONTROL_TOKEN).")
    )

    # ---------------------------------------------------------------- weight sync
    sync_backend: str = field(
        default="auto", metadata=_help("'gloo' (CPU), 'nccl' (GPU, trainer and server on different GPUs) or 'auto'.")
    )
    sync_bucket_mb: int = field(default=64, metadata=_help("Bucket size of a weight sync in MiB."))
    sync_shared_memory: bool = field(
        default=True,
        metadata=_help(
            "Into our CPU engine on this machine, send a sync's buckets through shared memory (/dev/shm) instead of "
            "the loopback socket (the same checks; gloo where /dev/shm lacks room or the server cannot see it)."
        ),
    )
    sync_changed_only: bool = field(
        default=False,
        metadata=_help(
            "Full fine-tuning: after the first sync, send only the elements whose wire-dtype (e.g. bf16) value "
            "changed, as indices and values (a whole tensor where that is smaller). Into our CPU engine or vLLM on "
            "a GPU over gloo (checked as every sync is), or over NCCL with vLLM's sparse_nccl engine (vf-rl starts "
            "vLLM with it; the first sync sends every index too, 3x the bf16 bytes once). The trainer keeps one "
            "more wire-dtype copy of the weights (the plan counts it). Not for LoRA, nor vLLM's CPU build."
        ),
    )
    lora_sync: str = field(
        default="auto",
        metadata=_help(
            "'merged' (send base+delta), 'adapter' (send only LoRA A/B: the server serves the policy as a LoRA "
            "adapter on untouched base weights; vLLM and the CPU engine), or 'auto': adapter when a LoRA policy's "
            "server shares the trainer's GPU, merged otherwise."
        ),
    )
    mismatch_kl_guard: float = field(
        default=10.0,
        metadata=_help(
            "At max_async_level = 0: stop when a step's mismatch_kl (the batch sampled right after a sync) exceeds "
            "this many times the median of the run's earlier steps and mismatch_kl_floor: a sync that did not land "
            "or landed wrong (docs/training.md); 0 turns the check off."
        ),
    )
    mismatch_kl_floor: float = field(
        default=1e-3,
        metadata=_help("mismatch_kl below this never stops a run (the noise floor of the mismatch_kl_guard check)."),
    )

    max_empty_steps: int = field(
        default=3,
        metadata=_help(
            "Stop with the cause after this many consecutive steps with nothing to train (every rollout rejected, "
            "errored or without reward spread is not counted here: only steps with no trainable sample)."
        ),
    )
    keep_server: bool = field(
        default=False,
        metadata=_help(
            "Keep a server the trainer spawned running after train() returns (evaluate() then reuses it); by default "
            "it is stopped, and evaluate() or the next train() start one again."
        ),
    )
    save_on_signal_timeout: float = field(
        default=60.0,
        metadata=_help(
            "On SIGTERM/Ctrl-C the last completed step is checkpointed; rollout batches still generating after this "
            "many seconds are left out of it (a resume generates them again)."
        ),
    )
    use_liger: bool = field(
        default=False, metadata=_help("Load a model given by name with Liger kernels (needs liger-kernel).")
    )

    # ---------------------------------------------------------------- logging / eval
    num_eval_examples: int | None = field(
        default=None, metadata=_help("Eval examples used by evaluate() (None: the whole eval split).")
    )
    eval_rollouts_per_example: int = field(default=1, metadata=_help("Rollouts per eval example."))
    eval_temperature: float | None = field(
        default=None,
        metadata=_help(
            "Sampling temperature of evaluate() (None: the training temperature; 0: greedy decoding). The other "
            "request fields are the training ones."
        ),
    )
    log_completions: bool = field(
        default=True, metadata=_help("Show a sample prompt/completion/reward every logging_steps (and a wandb table).")
    )
    num_completions_to_log: int = field(default=8, metadata=_help("Rows of the completions table per logged step."))

    # ---------------------------------------------------------------- the trained model
    final_model: str = field(
        default="merged+adapter",
        metadata=_help(
            "What train() writes to <output_dir>/final when it finishes, with a model card: 'merged+adapter' (LoRA "
            "merged into the weights, the adapter alone in final/adapter), 'merged', 'adapter' or 'none'. "
            "push_to_hub=True pushes that folder to hub_model_id (checkpoints stay local)."
        ),
    )

    on_settings_change: str = field(
        default="stop",
        metadata=_help(
            "A rerun into an output_dir whose newest checkpoint was trained with other settings (model, environment, "
            "optimizer, schedule, LoRA, batch, loss, sampling): 'stop' names each change and starts nothing; "
            "'continue' resumes it with the new values (not when the model, the LoRA shape or the optimizer "
            "changed); 'restart' removes its checkpoints and metrics and starts over."
        ),
    )

    # ---------------------------------------------------------------- TrainingArguments defaults that fit RL
    learning_rate: float = field(default=1e-5, metadata=_help("AdamW learning rate."))
    lr_scheduler_type: str = field(default="constant", metadata=_help("Learning-rate schedule."))
    logging_steps: float = field(default=1, metadata=_help("Log every N steps."))
    max_grad_norm: float = field(default=1.0, metadata=_help("Gradient clipping norm."))
    report_to: str | list[str] | None = field(default="none", metadata=_help("'wandb', 'tensorboard', ... or 'none'."))
    wandb: dict | None = field(
        default=None,
        metadata=_help(
            "wandb.init settings ([trainer.args.wandb] in TOML): project, name, entity, tags, group, notes, job_type, "
            "mode, dir. Setting it reports to wandb (report_to gains 'wandb'); name defaults to run_name."
        ),
    )
    save_strategy: str = field(default="steps", metadata=_help("When to checkpoint."))
    save_steps: float = field(default=50, metadata=_help("Checkpoint every N steps."))
    remove_unused_columns: bool = field(default=False, metadata=_help("Keep dataset columns (environments need them)."))

    def __post_init__(self):
        follow_launcher_precision(self)
        if self.output_dir is None:
            self.output_dir = os.path.join("outputs", self.run_name or "vf-rl")
        if self.server_api_key is None:
            self.server_api_key = os.environ.get("VLLM_API_KEY") or None
        self.sampling_args = effective_sampling_args(self, self.sampling_args)
        if self.wandb and self.report_to in (None, "none", [], ["none"]):
            self.report_to = "wandb"
        errors = check_config(self)
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
        if uneven := uneven_split(self.batch_size, self.micro_batch_size, max(self.world_size, 1)):
            raise ValueError(f"invalid RLConfig: batch_size={self.batch_size}: {uneven}")

    @property
    def n_gpu(self) -> int:
        """At most one GPU per process: Trainer would wrap the policy in `nn.DataParallel` over every visible GPU
        (the inference server's included) and count each step's batch once per GPU. Several GPUs train as several
        processes (`accelerate launch`, which `vf-rl` runs for `[trainer] gpus > 1`)."""
        return min(super().n_gpu, 1)

    @property
    def prompts_per_batch(self) -> int:
        return self.batch_size // self.rollouts_per_example

    @property
    def server_max_len(self) -> int:
        """The context limit of the server: prompt + completion tokens of one request."""
        return self.server_max_model_len or self.max_seq_len

    @property
    def prompt_limit(self) -> int:
        """Longest prompt (chat template and tool schemas included) kept in the dataset: one that leaves room for
        max_tokens within the server's context, unless max_prompt_len says otherwise."""
        if self.max_prompt_len is not None:
            return self.max_prompt_len
        return room_for_prompt(self.server_max_len, self.max_tokens)

    @property
    def token_budget(self) -> int:
        return self.micro_batch_tokens or self.micro_batch_size * self.max_seq_len

    def derive(self, **chosen) -> RLConfig:
        """A new RLConfig with `chosen` (the run plan's, the eval settings', vf-rl's server), checked as the user's
        was (`__post_init__` runs again); `self` stays as its owner built it. `sampling_args` holds the sampling
        fields (temperature, top_k, ...) as sent: the fields themselves hold them, so they are taken out of it."""
        sampling = dict(self.sampling_args or {})
        extra = dict(sampling.pop("extra_body", None) or {})
        for key in SAMPLING_FIELDS:
            sampling.pop(key, None)
            extra.pop(key, None)
        old_names = TRANSFORMERS_RENAMED.keys()  # the new names hold their values
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init and f.name not in old_names}
        new = object.__new__(type(self))
        # the dataclass __init__ itself: legacy names are translated already, and the given fields stay the user's
        init = type(self).__init__
        getattr(init, "__wrapped__", init)(
            new, **{**fields, "sampling_args": {**sampling, "extra_body": extra}, **chosen}
        )
        new.__dict__["given_fields"] = self.__dict__.get("given_fields", ())
        return new

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        if self.lora_config is not None:  # a LoraConfig holds sets, which JSON loggers cannot write
            d["lora_config"] = repr(self.lora_config)
        return d


RLConfig.__init__ = accept_legacy_names(RLConfig.__init__)

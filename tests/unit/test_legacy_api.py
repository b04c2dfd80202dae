"""What scripts written for upstream vf.RLTrainer / vf.GRPOTrainer pass keeps working, or says what replaced it.

Field lists come from verifiers' public history (0.1.6 GRPOConfig, 0.1.14 RLConfig)."""

from __future__ import annotations

import warnings

import pytest
import verifiers as vf
from peft import LoraConfig

from verifiers_rl.config.legacy import REMOVED
from verifiers_rl.rl.trainer import GRPOConfig, RLConfig, RLTrainer, grpo_defaults, lora_defaults

# Every field verifiers 0.1.14's RLConfig declared, at a value a user could have set (bf16 off: this is a CPU).
UPSTREAM_0_1_14 = dict(
    use_liger=False, use_lora=True, lora_rank=8, lora_alpha=32, lora_dropout=0.0, lora_target_modules="all-linear",
    lora_modules_to_save=None, lora_use_rslora=False, lora_config=None, rollouts_per_example=16, batch_size=512,
    micro_batch_size=8, max_seq_len=2048, max_prompt_len=512, max_steps=500, max_concurrent=1024,
    learning_rate=1e-5, adam_beta1=0.9, adam_beta2=0.999, weight_decay=0.0, mask_ratio_low=0.125,
    mask_ratio_high=8.0, mask_env_responses=True, mask_truncated_completions=False, zero_truncated_completions=False,
    max_tokens=None, temperature=1.0, top_p=1.0, top_k=None, min_p=0.0, repetition_penalty=1.0,
    presence_penalty=0.0, frequency_penalty=0.0, generation_timeout=600.0, vllm_server_host="0.0.0.0",
    vllm_server_port=8000, vllm_server_timeout=300.0, run_name="upstream", lr_scheduler_type="constant",
    bf16=False, max_grad_norm=1.0, gradient_checkpointing=False, save_strategy="steps", save_steps=50,
    eval_strategy="no", eval_steps=50, save_only_model=True, logging_steps=1, log_on_each_node=False,
    report_to="none", remove_unused_columns=False, shuffle_dataset=True,
)  # fmt: skip


def test_every_upstream_rlconfig_field_is_accepted(tmp_path):
    cfg = RLConfig(output_dir=str(tmp_path), use_cpu=True, **UPSTREAM_0_1_14)
    for name, value in UPSTREAM_0_1_14.items():
        if name != "report_to":  # TrainingArguments normalises "none" to []
            assert getattr(cfg, name) == value, name
    assert cfg.report_to == []
    # upstream exposed the request fields as a dict attribute
    assert cfg.sampling_args["temperature"] == 1.0 and cfg.sampling_args["logprobs"] is True


def test_shim_names_are_ours():
    import verifiers_rl.rl.trainer as ours

    for name in ("RLTrainer", "RLConfig", "GRPOTrainer", "GRPOConfig", "grpo_defaults", "lora_defaults"):
        assert getattr(vf, name) is getattr(ours, name), name
    assert vf.get_model_and_tokenizer is ours.get_model_and_tokenizer


def test_grpo_config_names_are_translated_with_a_warning(tmp_path):
    with pytest.warns(DeprecationWarning) as caught:
        cfg = GRPOConfig(
            output_dir=str(tmp_path), use_cpu=True, num_generations=4, max_prompt_length=100,
            max_completion_length=32, beta=0.0, async_generation_timeout=90.0, num_batches_ahead=2,
            batch_size=16, scale_rewards=False, max_seq_len=256,
        )  # fmt: skip
    text = " ".join(str(w.message) for w in caught)
    assert "num_generations" in text and "rollouts_per_example" in text
    assert (cfg.rollouts_per_example, cfg.max_prompt_len, cfg.max_tokens) == (4, 100, 32)
    assert (cfg.kl_beta, cfg.generation_timeout, cfg.max_async_level) == (0.0, 90.0, 2)
    assert cfg.scale_rewards == "none"


@pytest.mark.parametrize("name", sorted(REMOVED))
def test_removed_names_say_what_replaced_them(tmp_path, name):
    with pytest.raises(ValueError, match=f"{name} is no longer supported: "):
        RLConfig(output_dir=str(tmp_path), use_cpu=True, **{name: 1})


def test_hf_batch_fields_are_not_silently_dropped(tmp_path):
    with pytest.warns(UserWarning, match="per_device_train_batch_size=...\\) is ignored: set micro_batch_size"):
        cfg = RLConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4)
    assert cfg.per_device_train_batch_size == 1
    with pytest.warns(UserWarning, match="gradient_accumulation_steps"):
        RLConfig(output_dir=str(tmp_path), use_cpu=True, gradient_accumulation_steps=8)


def test_sampling_args_dict_is_honoured(tmp_path):
    cfg = RLConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        sampling_args={"temperature": 0.7, "max_tokens": 64, "stop": ["</answer>"],
                       "extra_body": {"top_k": 20, "skip_special_tokens": False}},
    )  # fmt: skip
    assert cfg.temperature == 0.7 and cfg.max_tokens == 64 and cfg.top_k == 20  # the trainer scores with these
    sa = cfg.sampling_args
    assert sa["temperature"] == 0.7 and sa["stop"] == ["</answer>"]
    assert sa["extra_body"] == {
        "skip_special_tokens": False, "return_token_ids": True, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.0
    }  # fmt: skip
    with pytest.raises(ValueError, match="rollouts_per_example"):
        RLConfig(output_dir=str(tmp_path), use_cpu=True, sampling_args={"n": 4})


def test_peft_config_wins_over_lora_fields(tmp_path):
    from verifiers_rl.tiny import build_tiny_model

    model, tok = build_tiny_model()
    env = vf.SingleTurnEnv(
        dataset=__import__("datasets").Dataset.from_list([{"question": "hi", "answer": "ih"}] * 4),
        rubric=vf.Rubric(funcs=[lambda completion, **k: 0.0]),
    )
    args = RLConfig(output_dir=str(tmp_path), use_cpu=True, lora_rank=8, use_lora=False, batch_size=8,
                    rollouts_per_example=4, micro_batch_size=4, max_seq_len=128)  # fmt: skip
    peft = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], task_type="CAUSAL_LM")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        trainer = vf.GRPOTrainer(model=model, processing_class=tok, env=env, args=args, peft_config=peft)
    lc = trainer.model.peft_config["default"]
    assert lc.r == 2 and set(lc.target_modules) == {"q_proj"} and trainer.args.use_lora
    assert args.use_lora is False and args.lora_config is None  # the caller's RLConfig stays as they built it
    # RLConfig(lora_config=...) does the same for RLTrainer
    args2 = RLConfig(output_dir=str(tmp_path / "b"), use_cpu=True, lora_config=peft, batch_size=8,
                     rollouts_per_example=4, micro_batch_size=4, max_seq_len=128)  # fmt: skip
    assert RLTrainer._wrap_lora(build_tiny_model()[0], args2).peft_config["default"].r == 2
    assert "LoraConfig" in args2.to_dict()["lora_config"]  # loggers can write it


def test_old_helpers_work_with_a_warning():
    with pytest.warns(DeprecationWarning, match="RLConfig"):
        cfg = grpo_defaults("my-run", use_cpu=True)
    assert cfg.output_dir.endswith("my-run")
    with pytest.warns(DeprecationWarning):
        lc = lora_defaults()
    assert isinstance(lc, LoraConfig) and lc.r == 8


def test_sandbox_envs_of_the_0_1_14_era_construct():
    """verifiers 0.1.14's PythonEnv builds a CreateSandboxRequest that prime-sandboxes 0.3+ rejects; the install
    pins what verifiers 0.1.14 was locked with."""
    from datasets import Dataset

    env = vf.PythonEnv(
        dataset=Dataset.from_list([{"question": "1+1", "answer": "2"}]),
        rubric=vf.Rubric(funcs=[lambda completion, **k: 0.0]),
    )
    assert type(env.sandbox_request).__name__ == "CreateSandboxRequest"

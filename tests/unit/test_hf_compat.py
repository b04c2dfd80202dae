"""Activation checkpointing by its transformers 5.20+ name on every transformers the project admits (hf_compat.py):
vLLM 0.32, the `vllm` extra, pins transformers < 5.20, where TrainingArguments only has `gradient_checkpointing`.
CI runs this file in the vLLM venv too (.ci/run), on the transformers vLLM brings."""

import dataclasses

import transformers

from verifiers_rl.trainer import RLConfig

NEW_NAMES = "activation_checkpointing" in {f.name for f in dataclasses.fields(transformers.TrainingArguments)}


def test_activation_checkpointing_reaches_the_field_trainer_reads(tmp_path):
    kwargs = {"use_reentrant": False}
    args = RLConfig(output_dir=str(tmp_path), use_cpu=True, activation_checkpointing=True,
                    activation_checkpointing_kwargs=kwargs)  # fmt: skip
    assert args.activation_checkpointing and args.activation_checkpointing_kwargs == kwargs
    if not NEW_NAMES:  # transformers < 5.20: its Trainer reads the old names
        assert args.gradient_checkpointing and args.gradient_checkpointing_kwargs == kwargs


def test_off_by_default_and_the_old_name_still_accepted(tmp_path):
    assert not RLConfig(output_dir=str(tmp_path), use_cpu=True).activation_checkpointing
    assert RLConfig(output_dir=str(tmp_path), use_cpu=True, gradient_checkpointing=True).activation_checkpointing

"""A notebook user's RLConfig is theirs: the trainer, the plan and the eval settings derive new, checked configs
from it (`RLConfig.derive`) and leave the object as it was built."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from rl_envs import reverse_env
from runs import tiny_rl_config

from verifiers_rl.trainer import RLConfig, RLTrainer


def _fields(args: RLConfig) -> dict:
    return copy.deepcopy(dataclasses.asdict(args))


def test_training_leaves_the_users_config_as_built(tiny_model_dir, tmp_path):
    from peft import LoraConfig

    with pytest.warns(UserWarning, match="use_lora=False"):  # the tiny config's lora_* fields: peft_config wins
        args = tiny_rl_config(tmp_path, max_steps=1, use_lora=False, eval_temperature=0.5)
    built, given = _fields(args), args.given_fields
    peft_config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = RLTrainer(model=tiny_model_dir, env=reverse_env(), args=args, peft_config=peft_config)
    try:
        assert trainer.args is not args and trainer.args.use_lora and trainer.args.lora_config is peft_config
        assert hasattr(trainer.model, "peft_config")  # the peft_config trained, not the user's use_lora=False
        trainer.train()
        assert trainer.state.global_step == 1
        greedy = trainer.evaluate(metric_key_prefix="eval_greedy", temperature=0.0)  # [eval] greedy's path
        assert greedy["eval_greedy/rollouts"] > 0
    finally:
        trainer.close()
    after = _fields(args)
    assert [k for k in built if built[k] != after[k]] == []  # field by field, the user's object as built
    assert args.given_fields == given and args.use_lora is False and args.eval_temperature == 0.5


def test_derive_checks_again_and_keeps_the_sampling_the_user_set(tmp_path):
    args = RLConfig(output_dir=str(tmp_path), use_cpu=True, temperature=0.7, sampling_args={"extra_body": {"top_k": 5}})
    built = _fields(args)
    new = args.derive(eval_temperature=0.0, activation_checkpointing=True)
    assert (new.eval_temperature, new.activation_checkpointing) == (0.0, True)
    assert new.sampling_args == args.sampling_args and new.top_k == 5 and new.given_fields == args.given_fields
    assert _fields(args) == built
    hotter = args.derive(temperature=1.0)  # a sampling field chosen: the request says so too
    assert hotter.sampling_args["temperature"] == 1.0 and hotter.sampling_args["extra_body"]["top_k"] == 5
    with pytest.raises(ValueError, match="eval_temperature"):  # the derived config is checked as the user's was
        args.derive(eval_temperature=-1.0)
    with pytest.raises(ValueError, match="batch_size"):
        args.derive(micro_batch_size=3)

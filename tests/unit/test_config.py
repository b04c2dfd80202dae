"""Every RLConfig field does what its name says.

Two walks over the fields RLConfig adds to TrainingArguments: (1) each one is read by the library outside
config.py (a field nobody reads does nothing); (2) the ones with a direct, cheap effect are checked for that
effect here. Trainer-level effects (LoRA, async level, losses, resume, masking) are covered in test_trainer.py.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from transformers import TrainingArguments

from verifiers_rl.config.checks import describe_sampling
from verifiers_rl.config.rl_config import DEFAULT_LORA_TARGETS, RLConfig

LIB = Path(__file__).resolve().parents[2] / "verifiers_rl"
OURS = [
    f.name
    for f in dataclasses.fields(RLConfig)
    if f.name not in {g.name for g in dataclasses.fields(TrainingArguments)}
]
ESTABLISHED = (
    "use_lora lora_rank lora_alpha lora_dropout lora_target_modules lora_modules_to_save lora_use_rslora "
    "rollouts_per_example batch_size micro_batch_size max_seq_len max_prompt_len max_concurrent mask_ratio_low "
    "mask_ratio_high mask_env_responses mask_truncated_completions zero_truncated_completions max_tokens temperature "
    "top_p top_k min_p repetition_penalty presence_penalty frequency_penalty generation_timeout vllm_server_host "
    "vllm_server_port vllm_server_timeout shuffle_dataset"
).split()


def _library_source() -> str:
    return "\n".join(p.read_text() for p in LIB.rglob("*.py") if p.name != "config.py")


def test_established_field_names_exist():
    names = {f.name for f in dataclasses.fields(RLConfig)}
    assert set(ESTABLISHED) <= names
    assert "max_steps" in names and "max_async_level" in names


@pytest.mark.parametrize("name", OURS)
def test_every_field_is_read_by_the_library(name):
    src = _library_source()
    config_src = (LIB / "config" / "rl_config.py").read_text()
    used = re.search(rf"\.{name}\b", src) or re.search(rf"self\.{name}\b", config_src.split("def __post_init__")[1])
    assert used, f"RLConfig.{name} is never read: it would do nothing"


def _cfg(**kw) -> RLConfig:
    return RLConfig(output_dir="/tmp/vf-rl-config-test", use_cpu=True, **kw)


def test_sampling_fields_reach_the_request():
    cfg = _cfg(
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.3,
        frequency_penalty=0.2,
        max_tokens=33,
    )
    sa = cfg.sampling_args
    assert sa["temperature"] == 0.7 and sa["top_p"] == 0.9 and sa["max_tokens"] == 33
    assert sa["presence_penalty"] == 0.3 and sa["frequency_penalty"] == 0.2
    assert sa["extra_body"] == {"return_token_ids": True, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}
    assert sa["logprobs"] is True


def test_sampling_defaults_go_out_explicitly():
    """A field the request leaves out is filled by the server from the checkpoint's generation_config.json (vLLM
    without `--generation-config vllm`: Qwen3's top_k 20, top_p 0.95, temperature 0.6), so the neutral values go
    out too: the distribution sampled is the one the trainer scores, whichever server answers."""
    sa = _cfg().sampling_args
    assert sa["temperature"] == 1.0 and sa["top_p"] == 1.0
    assert sa["presence_penalty"] == 0.0 and sa["frequency_penalty"] == 0.0
    assert sa["extra_body"] == {"return_token_ids": True, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
    assert "max_tokens" not in sa
    assert _cfg(min_p=None).sampling_args["extra_body"]["min_p"] == 0.0
    # the request a config writes is a fixed point: a config built from it sends the same request
    assert RLConfig(output_dir="/tmp/vf-rl-config-test", use_cpu=True, sampling_args=sa).sampling_args == sa
    # what `vf-rl --dry-run` shows under `# sampling`
    assert describe_sampling(_cfg(max_tokens=64, top_k=20).sampling_args) == (
        "temperature=1.0 top_p=1.0 top_k=20 min_p=0.0 repetition_penalty=1.0 presence_penalty=0.0 "
        "frequency_penalty=0.0 max_tokens=64"
    )


def test_batch_geometry():
    cfg = _cfg(batch_size=64, rollouts_per_example=8, micro_batch_size=4, max_seq_len=256)
    assert cfg.prompts_per_batch == 8
    assert cfg.token_budget == 4 * 256
    assert _cfg(micro_batch_tokens=999).token_budget == 999
    # one optimizer step per rollout batch; micro-batching happens inside training_step
    assert cfg.per_device_train_batch_size == 1 and cfg.gradient_accumulation_steps == 1


def test_defaults():
    cfg = _cfg()
    assert cfg.lora_target_modules == DEFAULT_LORA_TARGETS
    assert cfg.loss_type == "is" and cfg.max_async_level == 1 and cfg.scale_rewards == "group"
    assert cfg.epsilon_high == cfg.epsilon
    assert _cfg(loss_type="dapo").epsilon_high == 0.28
    assert cfg.output_dir == "/tmp/vf-rl-config-test"


def test_lora_fields_reach_peft():
    from verifiers_rl.tiny import build_tiny_model
    from verifiers_rl.trainer.trainer import RLTrainer

    model, _ = build_tiny_model()
    cfg = _cfg(
        lora_rank=4,
        lora_alpha=12,
        lora_dropout=0.1,
        lora_target_modules=["q_proj"],
        lora_modules_to_save=["lm_head"],
        lora_use_rslora=True,
    )
    peft = RLTrainer._wrap_lora(model, cfg)
    lc = peft.peft_config["default"]
    assert lc.r == 4 and lc.lora_alpha == 12 and lc.lora_dropout == 0.1 and lc.use_rslora
    assert set(lc.target_modules) == {"q_proj"} and lc.modules_to_save == ["lm_head"]
    layer = peft.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.scaling["default"] == pytest.approx(12 / 4**0.5)
    assert not hasattr(peft.base_model.model.model.layers[0].self_attn.k_proj, "lora_A")
    assert RLTrainer._wrap_lora(build_tiny_model()[0], _cfg(use_lora=False)).__class__.__name__ == "Qwen3ForCausalLM"


def test_gradient_checkpointing_is_taken_as_activation_checkpointing_without_a_warning():
    """transformers 5.2x renamed it (and warns on the old name); verifiers' and TRL's configs still use it."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = _cfg(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
        copy = dataclasses.replace(cfg)  # a copy carries both names, equal
    assert cfg.activation_checkpointing is True and copy.activation_checkpointing is True
    assert cfg.activation_checkpointing_kwargs == {"use_reentrant": False}
    assert _cfg().activation_checkpointing is False
    with pytest.raises(ValueError, match=r"gradient_checkpointing=False contradicts activation_checkpointing=True"):
        _cfg(gradient_checkpointing=False, activation_checkpointing=True)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(final_model="zip"), "final_model='zip': allowed: merged+adapter, merged, adapter, none"),
        (dict(final_model="adapter", use_lora=False), "final_model='adapter': 'adapter' needs use_lora=True"),
        (dict(final_model="none", push_to_hub=True), "final_model='none': 'none' leaves push_to_hub nothing to push"),
    ],
)
def test_final_model_rules(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _cfg(**kw)
    from verifiers_rl.config.schema import load_schema, rule_errors

    assert any(message in e for e in rule_errors(kw, load_schema())), "the TOML check says the same before torch"


ROOT = Path(__file__).resolve().parents[2]
RL_CONFIGS = sorted([*ROOT.glob("configs/vf-rl/*.toml"), *ROOT.glob("tests/data/upstream/*.toml")])


def test_the_editors_schema_is_generated_from_the_run_file():
    import json

    from verifiers_rl.config.run_file import json_schema
    from verifiers_rl.config.schema import SCHEMA_FILE

    committed = json.loads(SCHEMA_FILE.read_text())
    assert committed == json_schema(), "run_file.schema.json is stale: run python -m verifiers_rl.config.run_file"


@pytest.mark.parametrize("path", RL_CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_an_editor_with_the_schema_takes_every_shipped_config_and_flags_a_typo(path):
    """What an editor's TOML extension checks against `run_file.schema.json` agrees with `RunFile.read`: our configs
    and verifiers' own pass; a misspelled key in a section or in [trainer.args] is flagged by both."""
    import json
    import tomllib

    import jsonschema

    from verifiers_rl.config.run_file import RunFile
    from verifiers_rl.config.schema import SCHEMA_FILE
    from verifiers_rl.errors import ConfigError

    schema = json.loads(SCHEMA_FILE.read_text())
    data = tomllib.loads(path.read_text())
    jsonschema.validate(data, schema)
    RunFile.read(path)
    for section, typo in (("trainer", {"args": {"learning_rat": 1e-5}}), ("inference", {"gpus": "two"})):
        bad = {**data, section: {**data.get(section, {}), **typo}}
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
        with pytest.raises(ConfigError):
            RunFile.parse(bad)


def test_the_configuration_takes_one_path_from_vf_rl_to_its_plan():
    """`vf-rl --dry-run` traced (benchmarks/config_path.py) on a config with a warm-start's file: read and checked in
    config/, then planned; at most 20 stops and 4 climbs back to a module it had left. After the plan starts, config/
    only builds the RLConfig (`build_rl_config`)."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from config_path import DEFAULT, climbs, stops, trace

    path = stops(trace(DEFAULT))
    modules = [m for m, _ in path]
    assert len(path) <= 20 and len(climbs(path)) <= 4, path
    first_plan = modules.index("verifiers_rl.scripts.rl_plan")
    assert all(m.startswith("verifiers_rl.config.") for m in modules[:first_plan]), modules
    later = [f for m, functions in path[first_plan:] if m.startswith("verifiers_rl.config.") for f in functions]
    assert set(later) <= {"build_rl_config"}, path

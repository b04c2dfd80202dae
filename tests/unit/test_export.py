"""Exports without a server: the folder is whole or absent, checkpoints are recognised by their files, and the
model card says what the run did (and nothing secret). The end-to-end checks are in tests/e2e/test_final_model.py."""

from __future__ import annotations

import errno
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from verifiers_rl.config.lora import lora_config, wrap_lora
from verifiers_rl.export.card import ModelCard, eval_rows, run_history
from verifiers_rl.export.sources import layout
from verifiers_rl.export.writer import EXPORT_MANIFEST, export_model, is_export
from verifiers_rl.tiny import build_tiny_model
from verifiers_rl.trainer.final import without_secrets


@pytest.fixture
def lora_model():
    model, tokenizer = build_tiny_model()
    peft = wrap_lora(model, lora_config(4, 8))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return peft, tokenizer


def test_an_interrupted_export_leaves_the_previous_one_whole(tmp_path, lora_model, monkeypatch):
    model, tokenizer = lora_model
    out = tmp_path / "final"
    export_model(model, tokenizer, out, card=ModelCard(step=1, kind="merged+adapter"))
    before = (out / EXPORT_MANIFEST).read_text()

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(type(tokenizer), "save_pretrained", disk_full)
    with pytest.raises(OSError, match="No space left"):
        export_model(model, tokenizer, out, card=ModelCard(step=2, kind="merged+adapter"))
    assert (out / EXPORT_MANIFEST).read_text() == before and is_export(out)
    staged = tmp_path / ".final.staging"
    assert staged.is_dir() and not (staged / EXPORT_MANIFEST).exists()  # what a crash leaves: never a final/


def test_export_merges_out_of_place(tmp_path, lora_model):
    model, tokenizer = lora_model
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}
    export_model(model, tokenizer, tmp_path / "out", kind="merged")
    for name, p in model.named_parameters():
        if "base_layer" in name:
            assert torch.equal(p, base_before[name]), name
    merged = load_file(str(tmp_path / "out" / "model.safetensors"))
    layer = model.get_base_model().model.layers[0].self_attn.q_proj
    expected = layer.base_layer.weight + layer.get_delta_weight("default")
    torch.testing.assert_close(merged["model.layers.0.self_attn.q_proj.weight"], expected)
    assert not (tmp_path / "out" / "adapter").exists()


def test_a_fully_finetuned_model_has_no_adapter_to_export(tmp_path):
    model, tokenizer = build_tiny_model()
    with pytest.raises(ValueError, match="adapter-only export needs a LoRA"):
        export_model(model, tokenizer, tmp_path / "out", kind="adapter")
    assert not (tmp_path / "out").exists()
    export_model(model, tokenizer, tmp_path / "out")  # the default kind writes the model as it is
    assert json.loads((tmp_path / "out" / EXPORT_MANIFEST).read_text())["kind"] == "merged"
    assert layout(tmp_path / "out") == "full"


def test_checkpoint_layouts(tmp_path, lora_model):
    model, _ = lora_model
    model.save_pretrained(tmp_path / "lora")
    assert layout(tmp_path / "lora") == "adapter"
    empty = tmp_path / "zero3"  # ZeRO-3 without gathering: a placeholder adapter, the weights in the shards
    (empty / "global_step4").mkdir(parents=True)
    (empty / "adapter_config.json").write_text("{}")
    save_file({}, str(empty / "adapter_model.safetensors"))
    (empty / "global_step4" / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"")
    assert layout(empty) == "deepspeed"
    (tmp_path / "fsdp" / "pytorch_model_fsdp_0").mkdir(parents=True)
    (tmp_path / "fsdp" / "pytorch_model_fsdp_0" / "__0_0.distcp").write_bytes(b"")
    assert layout(tmp_path / "fsdp") == "dcp"
    assert layout(tmp_path) == ""


def test_card_facts_come_from_the_run_history(tmp_path):
    rows = [
        {"step": 0, "eval_before/reward": 0.25, "eval_before/rollouts": 8.0},
        {"step": 1, "reward": 0.3},
        {"step": 2, "reward": 0.4},
        {"step": 2, "eval_after/reward": 0.5, "eval_after/rollouts": 8.0},
        {"step": 3, "reward": 0.9},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "rew')
    history = run_history(tmp_path, 2, log_history=[])
    assert [r["step"] for r in history] == [0, 1, 2, 2]  # up to the exported step; a torn last line is skipped
    assert [(r["name"], r["reward"]) for r in eval_rows(history)] == [("eval_before", 0.25), ("eval_after", 0.5)]
    card = ModelCard(step=2, kind="merged+adapter", base_model="Qwen/Qwen3-0.6B", env_id="reverse-text",
                     env_args={"system_prompt": "Reverse."}, log_history=history)  # fmt: skip
    card.write(tmp_path)
    text = (tmp_path / "README.md").read_text()
    assert "base_model: Qwen/Qwen3-0.6B" in text and "- reverse-text" in text
    assert "| eval_before | 0 | 0.2500 | 8 |" in text and "| eval_after | 2 | 0.5000 | 8 |" in text
    assert "vf-eval reverse-text -m MODEL_DIR" in text and '"system_prompt": "Reverse."' in text
    assert (tmp_path / "reward_curve.png").stat().st_size > 1000
    local = ModelCard(step=2, kind="merged", base_model=str(tmp_path)).render()
    assert "base_model:" not in local  # a local path is no hub model id: the hub would reject the card
    from verifiers_rl.scripts.report import plot_reward_curve

    assert plot_reward_curve(tmp_path).stat().st_size > 1000  # the end-of-run report reads the same torn file


def test_secrets_never_reach_a_card():
    cfg = {"trainer": {"args": {"hub_token": "hf_x", "server_api_key": "k", "learning_rate": 1e-3}}, "model": "m"}
    assert without_secrets(cfg) == {"trainer": {"args": {"learning_rate": 1e-3}}, "model": "m"}


def test_export_keeps_the_checkpoints_use_cache_and_tokenizer(kit_model_dir, tmp_path):
    """A Trainer sets config.use_cache = False on the model it trains; the export writes what the checkpoint had
    (a plain generate() on it then uses its KV cache) and the tokenizer as it was (ids, template, added tokens)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(kit_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(kit_model_dir)
    assert model.config.use_cache is True
    model.config.use_cache = False  # what transformers.Trainer.__init__ does (TrainingArguments.use_cache)
    out = export_model(wrap_lora(model, lora_config(4, 8)), tokenizer, tmp_path / "final", kind="merged")
    assert json.loads((out / "config.json").read_text())["use_cache"] is True
    assert model.config.use_cache is False  # the training run keeps its own setting
    exported = AutoTokenizer.from_pretrained(out)
    messages = [
        {"role": "user", "content": "Hello world"},
        {"role": "assistant", "content": "<think>\nx\n</think>\n\ny"},
    ]
    assert exported.apply_chat_template(messages, tokenize=False) == tokenizer.apply_chat_template(
        messages, tokenize=False
    )
    assert (
        len(exported) == len(tokenizer)
        and exported("Hello world")["input_ids"] == tokenizer("Hello world")["input_ids"]
    )


def test_a_checkpoint_saved_without_a_cache_exports_as_it_was(tmp_path):
    model, tokenizer = build_tiny_model()
    model.config.use_cache = False
    model.save_pretrained(tmp_path / "base")
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    out = export_model(loaded, tokenizer, tmp_path / "final", kind="merged")
    assert json.loads((out / "config.json").read_text())["use_cache"] is False

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from verifiers_rl.tiny import TinySpec, build_tiny_model, save_tiny_model


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_round_trip_identical_logits(tmp_path):
    model, tok = build_tiny_model(seed=3)
    save_tiny_model(tmp_path, seed=3)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.tensor([tok("round trip ✓")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert loaded.config.tie_word_embeddings is False
    assert loaded.config.head_dim >= 32
    assert not torch.equal(loaded.lm_head.weight, loaded.model.embed_tokens.weight)


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    a, b, c = (save_tiny_model(tmp_path / n, seed=s) for n, s in (("a", 7), ("b", 7), ("c", 8)))
    assert _sha(a / "model.safetensors") == _sha(b / "model.safetensors")
    assert _sha(a / "model.safetensors") != _sha(c / "model.safetensors")
    assert _sha(a / "tokenizer.json") == _sha(b / "tokenizer.json")


def test_build_does_not_disturb_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_tokenizer_special_tokens(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"
    assert tok.pad_token_id != tok.eos_token_id
    assert tok.convert_tokens_to_ids("<|im_start|>") not in (tok.pad_token_id, tok.eos_token_id)
    # ids 0..255 are the raw bytes
    assert tok("A")["input_ids"] == [ord("A")]


@pytest.mark.parametrize("text", ["hello", "héllo wörld", "世界 🎉\n\ttabs", " leading and trailing ", ""])
def test_utf8_round_trip(tiny_model_dir, text):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok(text)["input_ids"]
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_chat_template_renders_qwen_format(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "Ünïcode 🎉"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nÜnïcode 🎉<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"]
    assert tok.decode(ids) == text
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3


def test_chat_template_tools_and_tool_responses(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
        {"role": "tool", "content": "4", "tool_call_id": "c2"},
    ]
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert '<tools>\n{"type": "function"' in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call><|im_end|>\n' in text
    )
    assert (
        "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n4\n</tool_response><|im_end|>\n"
        in text
    )
    assert text.endswith("<|im_start|>assistant\n")


def test_generation_works(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, return_tensors="pt")[
        "input_ids"
    ]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    assert out[0, ids.shape[1] :].max() < len(tok)
    again = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, again)


def test_cli_writes_loadable_model(tmp_path):
    out = tmp_path / "cli"
    r = subprocess.run(
        [sys.executable, "-m", "verifiers_rl.tiny", str(out), "--hidden", "64", "--layers", "1", "--seed", "5"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 1 and model.config.hidden_size == 64
    ref, _ = build_tiny_model(hidden=64, layers=1, seed=5)
    for (n, p), (n2, p2) in zip(model.named_parameters(), ref.named_parameters()):
        assert n == n2 and torch.equal(p, p2)


def test_cli_rejects_bad_shape(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "verifiers_rl.tiny", str(tmp_path / "x"), "--hidden", "48"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert "hidden=48 must be a positive multiple of head_dim=32" in r.stderr
    assert "Traceback" not in r.stderr


def test_spec_validation():
    with pytest.raises(ValueError, match="layers=0"):
        TinySpec(layers=0)

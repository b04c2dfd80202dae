"""The CPU server's model built from the checkpoint without transformers' modeling code (cpu/model/lean_model.py): the
same parameters as `from_pretrained` (names, order, shapes, dtypes, values, tying), the same RoPE tables and
logits, the fall-backs to transformers for what it does not read, and the import it exists to avoid."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from decoders import KINDS, decoder
from safetensors.torch import load_file, save_file

from verifiers_rl.inference.cpu.engines import load_engine
from verifiers_rl.inference.cpu.model.kv_cache import SlotKVCache
from verifiers_rl.inference.cpu.model.lean_forward import LeanDecoder, unsupported_reason
from verifiers_rl.inference.cpu.model.lean_model import LeanCausalLM, load_lean_model
from verifiers_rl.models import get_model
from verifiers_rl.tiny import build_tokenizer


def _saved(tmp_path, kind: str, **save_kwargs) -> str:
    model = decoder(kind)
    with torch.no_grad():  # norms initialise to ones: make every tensor distinct so a swapped name shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    folder = str(tmp_path / kind)
    model.save_pretrained(folder, **save_kwargs)
    build_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", KINDS)
def test_same_parameters_rope_and_logits_as_from_pretrained(tmp_path, kind):
    folder = _saved(tmp_path, kind)
    lean, why = load_lean_model(folder)
    assert why is None and isinstance(lean, LeanCausalLM)
    hf = get_model(folder, device="cpu").eval()

    ours, theirs = list(lean.named_parameters()), list(hf.named_parameters())
    assert [(n, p.shape, p.dtype) for n, p in ours] == [(n, p.shape, p.dtype) for n, p in theirs]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(ours, theirs))
    tied = hf.config.tie_word_embeddings
    assert (lean.lm_head.weight is lean.model.embed_tokens.weight) == tied
    assert tied or not torch.equal(lean.lm_head.weight, lean.model.embed_tokens.weight)
    assert lean.generation_config.eos_token_id == hf.generation_config.eos_token_id

    x, positions = torch.zeros(1, dtype=torch.float32), torch.arange(300)[None]
    for a, b in zip(lean.model.rotary_emb(x, positions), hf.model.rotary_emb(x, positions)):
        assert torch.equal(a, b)

    assert unsupported_reason(lean) is None
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 261, (2, 9), generator=g)
    lengths = torch.tensor([9, 6])
    logits = []
    for model in (lean, hf):
        dec = LeanDecoder(model, 64)
        cache = SlotKVCache(2, dec.num_kv_heads, dec.head_dim, max_slots=2, max_length=64)
        cache.ensure(2, 16)
        logits.append(dec.prefill(tokens, lengths, cache, 0))
    assert torch.equal(logits[0], logits[1])
    with torch.no_grad():
        ref = hf(tokens[1:, :6]).logits[0, -1]
    torch.testing.assert_close(logits[0][1], ref, atol=1e-5, rtol=1e-5)


def test_a_sharded_checkpoint_loads_whole(tmp_path):
    folder = _saved(tmp_path, "llama3-mha", max_shard_size="40KB")
    assert os.path.exists(os.path.join(folder, "model.safetensors.index.json"))
    lean, why = load_lean_model(folder)
    assert why is None
    hf = dict(get_model(folder, device="cpu").named_parameters())
    assert all(torch.equal(p, hf[n]) for n, p in lean.named_parameters())


def test_without_generation_config_it_derives_one_as_transformers_does(tmp_path):
    folder = _saved(tmp_path, "qwen3")
    os.remove(os.path.join(folder, "generation_config.json"))
    lean, why = load_lean_model(folder)
    assert why is None
    hf = get_model(folder, device="cpu")
    assert lean.generation_config.eos_token_id == hf.generation_config.eos_token_id is not None


def _rewrite_weights(folder: str, change) -> None:
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_what_it_does_not_read_goes_to_transformers(tmp_path):
    lean, why = load_lean_model("vf-rl-tests/not-cached")  # a hub id not in the cache: transformers downloads it
    assert lean is None and "local folder" in why

    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = str(tmp_path / "gpt2")
    GPT2LMHeadModel(GPT2Config(vocab_size=261, n_embd=32, n_layer=1, n_head=2)).save_pretrained(gpt2)
    assert load_lean_model(gpt2) == (None, "model_type 'gpt2' (supported: llama, mistral, qwen2, qwen3)")

    folder = _saved(tmp_path, "qwen3")
    _rewrite_weights(folder, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    lean, why = load_lean_model(folder)
    assert lean is None and "unexpected ['model.layers.0.mlp.extra.weight']" in why

    folder = _saved(tmp_path, "qwen2")
    _rewrite_weights(folder, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    lean, why = load_lean_model(folder)  # q and v keep their biases: k's is missing, not absent by design
    assert lean is None and "missing ['model.layers.1.self_attn.k_proj.bias']" in why

    folder = _saved(tmp_path, "mistral")
    _rewrite_weights(folder, lambda t: t.update({"model.norm.weight": torch.ones(65)}))
    assert load_lean_model(folder) == (None, "model.norm.weight has shape (65,), the config says (64,)")

    os.remove(os.path.join(folder, "model.safetensors"))
    assert load_lean_model(folder) == (None, "no safetensors weights (or a shard missing)")

    folder = _saved(tmp_path, "llama3-mha")
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    cfg["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    assert load_lean_model(folder) == (None, "rope_type 'dynamic'")


def _hub_cache(tmp_path, folder: str, repo: str) -> str:
    """`folder` laid out as huggingface_hub's cache holds a downloaded repository (refs/main -> a snapshot)."""
    import shutil

    root = tmp_path / "hub" / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text("0" * 40)
    shutil.copytree(folder, root / "snapshots" / ("0" * 40))
    return str(tmp_path / "hub")


def test_a_hub_id_in_the_local_cache_loads_from_its_snapshot(tmp_path, monkeypatch):
    import huggingface_hub.constants

    folder = _saved(tmp_path, "qwen2", max_shard_size="40KB")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", _hub_cache(tmp_path, folder, "vf-rl-tests/tiny"))
    lean, why = load_lean_model("vf-rl-tests/tiny")
    assert why is None
    hf = dict(get_model(folder, device="cpu").named_parameters())
    assert all(torch.equal(p, hf[n]) for n, p in lean.named_parameters())
    # part of a sharded checkpoint in the cache (an interrupted download): transformers fetches the rest
    snapshot = tmp_path / "hub" / "models--vf-rl-tests--tiny" / "snapshots" / ("0" * 40)
    os.remove(sorted(snapshot.glob("model-*.safetensors"))[-1])
    assert load_lean_model("vf-rl-tests/tiny") == (None, "no safetensors weights (or a shard missing)")


def test_load_engine_builds_the_lean_model_and_cb_keeps_transformers(tmp_path):
    folder = _saved(tmp_path, "qwen3")
    engine = load_engine(folder, max_model_len=64, max_num_seqs=2)
    try:
        assert type(engine).__name__ == "SlotEngine" and isinstance(engine.model, LeanCausalLM)
    finally:
        engine.close()
    engine = load_engine(folder, impl="cb", max_model_len=64, max_num_seqs=2)
    try:
        assert type(engine).__name__ == "CPUEngine" and type(engine.model).__name__ == "Qwen3ForCausalLM"
    finally:
        engine.close()


def test_the_server_loads_without_transformers_modeling_code(tmp_path):
    """What the lean build is for: the CPU server's process never imports transformers' modeling stack (and with
    it torch._dynamo and sympy), seconds of every server start on 2 cores."""
    folder = _saved(tmp_path, "qwen3")
    probe = (
        "import sys\n"
        "from verifiers_rl.inference.cpu.engines import load_engine\n"
        f"engine = load_engine({folder!r}, max_model_len=64, max_num_seqs=2)\n"
        "heavy = ['transformers.modeling_utils', 'torch._dynamo', 'sympy']\n"
        "print(type(engine.model).__name__, [m for m in heavy if m in sys.modules])\n"
        "engine.close()\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split("\n")[0] == "LeanCausalLM []", out.stdout + out.stderr

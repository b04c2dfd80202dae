"""Small random decoders of every family the CPU engine's lean forward runs, shared by the slot-engine and
lean-model tests: the projections, biases, tying and RoPE variants each family brings."""

from __future__ import annotations

import torch

from verifiers_rl.tiny import build_tiny_model

COMMON = dict(vocab_size=261, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64, "rope_theta": 10000.0}  # fmt: skip
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 1e6}
LINEAR = {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}
KINDS = ["qwen3", "qwen3-yarn-untied", "qwen2", "llama3-mha", "llama-linear-biases", "mistral"]


def decoder(kind: str):
    """A transformers model of `kind` (one of KINDS), random weights from seed 0, in eval mode."""
    import transformers as t

    torch.manual_seed(0)
    if kind == "qwen3":  # tied embeddings, per-head q/k norms
        return build_tiny_model(hidden=64, layers=2)[0].eval()
    if kind == "qwen3-yarn-untied":
        cfg = t.Qwen3Config(**COMMON, head_dim=32, rope_parameters=YARN, tie_word_embeddings=False)
        return t.Qwen3ForCausalLM(cfg).eval()
    if kind == "qwen2":  # biases on q/k/v only
        return t.Qwen2ForCausalLM(t.Qwen2Config(**COMMON, tie_word_embeddings=True)).eval()
    if kind == "llama3-mha":
        cfg = t.LlamaConfig(**{**COMMON, "num_key_value_heads": 4}, rope_parameters=LLAMA3)
        return t.LlamaForCausalLM(cfg).eval()
    if kind == "llama-linear-biases":  # attention_bias and mlp_bias: every projection has one
        cfg = t.LlamaConfig(**COMMON, rope_parameters=LINEAR, attention_bias=True, mlp_bias=True)
        return t.LlamaForCausalLM(cfg).eval()
    if kind == "mistral":
        return t.MistralForCausalLM(t.MistralConfig(**COMMON, sliding_window=None)).eval()
    raise ValueError(kind)

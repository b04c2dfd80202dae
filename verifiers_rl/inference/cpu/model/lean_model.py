"""A supported decoder's module tree, built straight from its checkpoint folder for the CPU server's slot engine.

Why not `AutoModelForCausalLM.from_pretrained`: importing transformers' modeling code pulls in
torch.distributed.tensor, sympy and torch._dynamo (through its attention and kernel integrations), about 2 s of
a CPU server's 6 s start on 2 cores, and every run, restart and test pays it. The slot engine needs none of that
code: `lean_forward.LeanDecoder` runs its own arithmetic over the parameters. So for the architectures it
supports, this builds plain `nn.Linear` / `nn.Embedding` modules under transformers' names and in transformers'
registration order (the weight sync writes by name and lays buckets out in `named_parameters()` order, weights.py),
and loads the safetensors into them as `from_pretrained` does on CPU: float32, tied embeddings shared.

Anything this does not recognise returns None and the server loads the model through transformers as before: a
hub id not (wholly) in the local cache (this never uses the network), weights not in safetensors, a tensor name it
does not expect or one it expects and does not find, an architecture or RoPE variant the lean forward does not run.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from verifiers_rl.inference.cpu.model.lean_forward import config_problem

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


def _empty(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device="meta"))


# The modules are built without running their initialisers: on the meta device torch routes `normal_` and
# `uniform_` through its Python reference ops, whose first use imports torch._dynamo (1.7 s), the very import this
# module avoids; the checkpoint replaces every value anyway. They stay exactly nn.Linear / nn.Embedding, which the
# lean forward requires of the projections (lean_forward.unsupported_reason).
def _linear(n_in: int, n_out: int, bias: bool) -> nn.Linear:
    m = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(m)
    m.in_features, m.out_features = n_in, n_out
    m.weight = _empty(n_out, n_in)
    m.register_parameter("bias", _empty(n_out) if bias else None)
    return m


def _embedding(n: int, dim: int) -> nn.Embedding:
    m = nn.Embedding.__new__(nn.Embedding)
    nn.Module.__init__(m)
    m.num_embeddings, m.embedding_dim, m.padding_idx = n, dim, None
    m.max_norm, m.norm_type, m.scale_grad_by_freq, m.sparse = None, 2.0, False, False
    m.weight = _empty(n, dim)
    return m


class RMSNorm(nn.Module):
    """Holds a norm's weight and epsilon under transformers' attribute names (the lean forward does the math)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = _empty(size)
        self.variance_epsilon = eps


class RotaryEmbedding(nn.Module):
    """cos/sin per position as transformers' rotary modules compute them, for the RoPE types whose tables depend
    on the position alone (lean_forward.STATIC_ROPE_TYPES)."""

    def __init__(self, config, head_dim: int):
        super().__init__()
        rope = config.rope_parameters
        if rope["rope_type"] == "default":
            inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            self.attention_scaling = 1.0
        else:  # transformers' own initialisers: the same frequencies its modeling code uses
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config, head_dim: int, biases: dict[str, bool], qk_norm: bool):
        super().__init__()
        hidden, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.scaling = head_dim, head_dim**-0.5
        self.q_proj = _linear(hidden, heads * head_dim, biases["q_proj"])
        self.k_proj = _linear(hidden, kv * head_dim, biases["k_proj"])
        self.v_proj = _linear(hidden, kv * head_dim, biases["v_proj"])
        self.o_proj = _linear(heads * head_dim, hidden, biases["o_proj"])
        if qk_norm:  # Qwen3: RMSNorm over each head's vector
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)


class MLP(nn.Module):
    def __init__(self, config, biases: dict[str, bool]):
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = _linear(hidden, inter, biases["gate_proj"])
        self.up_proj = _linear(hidden, inter, biases["up_proj"])
        self.down_proj = _linear(inter, hidden, biases["down_proj"])


class DecoderLayer(nn.Module):
    def __init__(self, config, head_dim: int, biases: dict[str, bool], qk_norm: bool):
        super().__init__()
        self.self_attn = Attention(config, head_dim, biases, qk_norm)
        self.mlp = MLP(config, biases)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DecoderModel(nn.Module):
    def __init__(self, config, head_dim: int, biases: dict[str, bool], qk_norm: bool):
        super().__init__()
        self.embed_tokens = _embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, head_dim, biases, qk_norm) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, head_dim)


class LeanCausalLM(nn.Module):
    """`model.{embed_tokens, layers, norm, rotary_emb}` and `lm_head`, as transformers' *ForCausalLM lays them out;
    no forward of its own (the slot engine runs lean_forward.LeanDecoder over it)."""

    def __init__(self, config, generation_config, biases: dict[str, bool], qk_norm: bool):
        super().__init__()
        self.config, self.generation_config = config, generation_config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.model = DecoderModel(config, head_dim, biases, qk_norm)
        self.lm_head = _linear(config.hidden_size, config.vocab_size, False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


def _config_problem(config) -> str | None:
    problem = config_problem(config)
    if problem is not None:
        return problem
    if "rope_theta" not in (getattr(config, "rope_parameters", None) or {}):
        return "no rope_theta in rope_parameters"
    if getattr(config, "quantization_config", None):
        return "a quantized checkpoint"
    return None


def _local_folder(name_or_path: str) -> str | None:
    """The folder holding the checkpoint: the path itself, or a hub id's snapshot already in the local cache
    (as `from_pretrained` would resolve it, without the network); None for anything else."""
    path = os.path.expanduser(str(name_or_path))
    if os.path.exists(path):
        return path if os.path.isfile(os.path.join(path, "config.json")) else None
    try:
        from huggingface_hub import snapshot_download

        snapshot = snapshot_download(str(name_or_path), local_files_only=True)
    except Exception:  # noqa: BLE001 - not a hub id, or not cached: transformers resolves it (and downloads)
        return None
    return snapshot if os.path.isfile(os.path.join(snapshot, "config.json")) else None


def _read_tensors(folder: str) -> dict[str, torch.Tensor] | None:
    from safetensors.torch import load_file

    index = os.path.join(folder, WEIGHTS_INDEX)
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(folder, WEIGHTS)):
        files = [WEIGHTS]
    else:
        return None
    if not all(os.path.isfile(os.path.join(folder, name)) for name in files):
        return None  # a cache holding part of a sharded checkpoint: transformers fetches the rest
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(os.path.join(folder, name), device="cpu"))
    return tensors


def _biases(tensors: dict[str, torch.Tensor]) -> dict[str, bool]:
    """Which projections carry a bias, as the checkpoint says (Qwen2's q/k/v do; Llama's `attention_bias`...)."""
    kinds = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return {k: any(n.endswith(f".{k}.bias") for n in tensors) for k in kinds}


# Kept by bench_cpu_tunings' row "fresh process to loaded engine: from_pretrained vs lean_model" (>= 1.1x).
def load_lean_model(name_or_path: str) -> tuple[LeanCausalLM | None, str | None]:
    """(the model, None), or (None, why transformers should load it instead)."""
    folder = _local_folder(name_or_path)
    if folder is None:
        return None, "neither a local folder with config.json nor a hub id in the local cache"
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(folder)
    problem = _config_problem(config)
    if problem is not None:
        return None, problem
    tensors = _read_tensors(folder)
    if tensors is None:
        return None, "no safetensors weights (or a shard missing)"
    try:
        generation_config = GenerationConfig.from_pretrained(folder)
    except OSError:  # no generation_config.json: transformers derives one from the model config
        generation_config = GenerationConfig.from_model_config(config)
    model = LeanCausalLM(config, generation_config, _biases(tensors), qk_norm=config.model_type == "qwen3")
    if config.tie_word_embeddings:  # transformers ties whatever the file holds for the head
        tensors.pop("lm_head.weight", None)
    expected = {name for name, _ in model.named_parameters()}
    if set(tensors) != expected:
        extra, missing = sorted(set(tensors) - expected), sorted(expected - set(tensors))
        return None, f"tensor names differ (unexpected {extra[:3]}, missing {missing[:3]})"
    for name, param in model.named_parameters():
        if tuple(tensors[name].shape) != tuple(param.shape):
            return None, f"{name} has shape {tuple(tensors[name].shape)}, the config says {tuple(param.shape)}"
    dtype = torch.float32  # what models.get_model loads on CPU
    model.load_state_dict({n: t.to(dtype) for n, t in tensors.items()}, strict=False, assign=True)
    if config.tie_word_embeddings:  # assign replaced the embedding's Parameter: share it again
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval(), None

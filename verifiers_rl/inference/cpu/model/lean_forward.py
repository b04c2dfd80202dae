"""A lean forward pass for Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) over a slot KV cache.

The HF forward does the same arithmetic, but per step it also builds generic cache objects, masks and output
containers; on a small model at 32 concurrent requests that bookkeeping costs more than the matrix products
(each aten op costs microseconds on CPU whatever its size). This module runs the model's *own* parameters
with only the operations the arithmetic needs, and fewer of them:

- q/k/v and gate/up projections run as one matmul each: `_pack` moves each group's weights into one tensor and
  re-points the modules' parameters at views of it, so `named_parameters()`, `load_weights` and optimiser-style
  in-place copies still write where the forward reads (no second copy, never stale);
- RoPE uses a cos table and a sign-folded sin table from the model's own rotary module, and `roll` for
  rotate-half; q and k are normalised and rotated together;
- the KV cache is written with one `index_copy_` per layer; a decode step's attention is two batched matmuls over
  (sequence, KV head) pairs reading the slots' cached keys in place, a prefill's is causal SDPA over its own keys;
- residual adds ride in `addmm`, and each layer's tensors are looked up once (`_LayerWeights`);
- large fp32 weights multiply through oneDNN (`linear`), not F.linear's MKL GEMM: at the few rows a decode step
  has, MKL streams the weight at a fraction of the memory bandwidth (numbers at `ONEDNN_MIN_ELEMENTS`).

Arithmetic follows transformers' modeling code (float32 RMSNorm, rotate-half RoPE, same scaling), so logits match
HF within float rounding (tests/unit/test_slot_engine.py). `unsupported_reason` names what this does not cover; the
engine then falls back to transformers' continuous batching.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# RoPE variants whose cos/sin depend on the position only (dynamic/longrope rescale with the sequence length).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def config_problem(cfg) -> str | None:
    """Why the lean path cannot run a model of this config (None when the config allows it)."""
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {cfg.model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in STATIC_ROPE_TYPES:
        return f"rope_type {rope!r}"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return "sliding-window layers"
    if cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None):
        return "sliding-window attention"
    return None


def unsupported_reason(model) -> str | None:
    """Why the lean path cannot run `model` (None when it can)."""
    problem = config_problem(model.config)
    if problem is not None:
        return problem
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "no model.{embed_tokens, layers, norm, rotary_emb}"
    for layer in inner.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or not _plain(attn, ("q_proj", "k_proj", "v_proj", "o_proj")):
            return "a decoder layer without plain q/k/v/o projections (adapters wrapped in?)"
        if not _plain(mlp, ("gate_proj", "up_proj", "down_proj")):
            return "a decoder layer without a plain gated MLP"
    if not isinstance(getattr(model, "lm_head", None), torch.nn.Linear):
        return "no plain lm_head"
    if any(p.device.type != "cpu" for p in model.parameters()):
        return "parameters off the CPU"
    return None


def _plain(module, names) -> bool:
    return all(type(getattr(module, n, None)) is torch.nn.Linear for n in names)


# ------------------------------------------------------------------------------------------ pure math

# Weights of at least this many elements go through oneDNN's matmul (`torch.ops.mkldnn._linear_pointwise`, the
# kernel torch.compile's CPU backend emits for a linear layer) on the weight as it lies, no reordered copy, so the
# parameters stay the ones a sync writes. On large weights it beats F.linear (MKL), and uses a second thread
# where MKL's GEMV does not; below ~0.5M elements its per-call overhead loses
# (benchmarks/results/design_measurements.md#onednn-linear).
ONEDNN_MIN_ELEMENTS = 1 << 19


def _onednn_available() -> bool:
    try:
        w = torch.ones(2, 2)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2), w, None, "none", [], "")
        return bool(torch.backends.mkldnn.is_available()) and out.tolist() == [[2.0, 2.0]]
    except (AttributeError, RuntimeError):  # a build without oneDNN: F.linear everywhere
        return False


_ONEDNN = _onednn_available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through oneDNN for a large contiguous fp32 weight (see ONEDNN_MIN_ELEMENTS)."""
    if (
        _ONEDNN
        and weight.numel() >= ONEDNN_MIN_ELEMENTS
        and weight.dtype == torch.float32
        and x.dtype == torch.float32
        and weight.is_contiguous()
    ):
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), weight, bias, "none", [], "")
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalise in float32, cast back, then scale."""
    if x.dtype == torch.float32 and (weight is None or weight.dtype == torch.float32):
        return torch.rms_norm(x, (x.shape[-1],), weight, eps)  # not F.rms_norm: its Python checks cost ~5 us
    h = x.float()
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return h if weight is None else weight * h


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[L, D] cos/sin -> (cos, sin with its first half negated): rotate_half(x) * sin == roll(x) * signed_sin,
    since rotate_half(x) = cat(-x2, x1) and roll(x, D/2) = cat(x2, x1). Negation is exact in floating point."""
    half = sin.shape[-1] // 2
    return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] with cos/signed_sin broadcastable to it: transformers' x * cos + rotate_half(x) * sin."""
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), signed_sin)


def decode_mask(positions: torch.Tensor, kv_heads: int, k_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive [B * kv_heads, 1, k_len] mask: the new token of row b at positions[b] sees keys 0 .. positions[b]
    (rows in (b, kv head) order, matching the batched matmuls of `LeanDecoder.decode`)."""
    hidden = torch.arange(k_len)[None, :] > positions.repeat_interleave(kv_heads)[:, None]
    return torch.zeros(hidden.shape, dtype=dtype).masked_fill_(hidden, float("-inf"))[:, None, :]


def cache_rows(slots: torch.Tensor, positions: torch.Tensor, kv_heads: int, length: int) -> torch.Tensor:
    """Row indices into a [S, kvh, L, D] cache viewed as [S * kvh * L, D], for tokens at `positions` [B, T] of
    `slots` [B]: returns [B * T * kvh] in (b, t, head) order, matching keys laid out as [B, T, kvh, D]."""
    heads = torch.arange(kv_heads)
    return ((slots[:, None, None] * kv_heads + heads[None, None, :]) * length + positions[:, :, None]).reshape(-1)


# ------------------------------------------------------------------------------------------ weights


def _adjacent(tensors: list[torch.Tensor]) -> bool:
    """Whether the tensors are contiguous and laid out back to back in one storage, in this order."""
    if not all(t.is_contiguous() for t in tensors):
        return False
    storage = tensors[0].untyped_storage().data_ptr()
    end = tensors[0].data_ptr()
    for t in tensors:
        if t.untyped_storage().data_ptr() != storage or t.data_ptr() != end:
            return False
        end += t.numel() * t.element_size()
    return True


def _pack(modules: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the modules' weights (and biases) into one buffer and point each parameter at its slice. Weights
    already back to back in memory (the engine's flat parameter buffer) are packed as a view of that span."""
    weights = [m.weight.detach() for m in modules]
    if _adjacent(weights) and all(m.bias is None for m in modules):
        first = weights[0]
        rows = sum(w.shape[0] for w in weights)
        return first.as_strided((rows, first.shape[1]), first.stride()), None
    weight = torch.cat(weights, dim=0)
    biases = [m.bias for m in modules]
    if any(b is not None for b in biases) and any(b is None for b in biases):
        raise ValueError("projections with mixed biases")
    bias = torch.cat([b.detach() for b in biases], dim=0) if biases[0] is not None else None
    row = 0
    for m in modules:
        n = m.weight.shape[0]
        m.weight.data = weight[row : row + n]
        if bias is not None:
            m.bias.data = bias[row : row + n]
        row += n
    return weight, bias


class _LayerWeights:
    """One decoder layer's tensors, looked up once (module attribute lookups cost ~1 us each, per step).

    Holds the Parameter objects themselves, so in-place updates and `.data` swaps of unpacked parameters are
    seen; q/k/v and gate/up live in packed buffers (`_pack`), and Qwen3's per-head q/k norm weights are
    concatenated into one [heads + kv_heads, D] tensor, rebuilt when either parameter changes (`_version`)."""

    def __init__(self, layer, num_heads: int, num_kv_heads: int):
        attn, mlp = layer.self_attn, layer.mlp
        self.ln1, self.eps1 = layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon
        self.ln2, self.eps2 = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon
        self.o_w, self.o_b = attn.o_proj.weight, attn.o_proj.bias
        self.down_w, self.down_b = mlp.down_proj.weight, mlp.down_proj.bias
        self.packed_mods = [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj]
        self.qkv_w, self.qkv_b = _pack(self.packed_mods[:3])
        self.gu_w, self.gu_b = _pack(self.packed_mods[3:])
        self.q_norm = getattr(attn, "q_norm", None)
        self.k_norm = getattr(attn, "k_norm", None)
        self.heads = (num_heads, num_kv_heads)
        self._qk_key = None
        self.qk_w = None
        self.qk_eps = self.q_norm.variance_epsilon if self.q_norm is not None else 0.0

    def packed_valid(self) -> bool:
        mods, bufs = self.packed_mods, (self.qkv_w,) * 3 + (self.gu_w,) * 2
        return all(_inside(m.weight, b) for m, b in zip(mods, bufs))

    def qk_weight(self) -> torch.Tensor | None:
        if self.q_norm is None:
            return None
        qw, kw = self.q_norm.weight, self.k_norm.weight
        key = (qw.data_ptr(), qw._version, kw.data_ptr(), kw._version)
        if key != self._qk_key:
            (h, kvh), d = self.heads, qw.shape[0]
            with torch.no_grad():
                self.qk_w = torch.cat((qw.detach().expand(h, d), kw.detach().expand(kvh, d)))
            self._qk_key = key
        return self.qk_w


def _inside(t: torch.Tensor, buf: torch.Tensor) -> bool:
    lo = buf.data_ptr()
    return lo <= t.data_ptr() < lo + buf.numel() * buf.element_size()


# ------------------------------------------------------------------------------------------ forward


# Kept by bench_cpu_tunings' row "engine loop: transformers CB vs slots + lean forward" (>= 1.15x).
class LeanDecoder:
    """Forward passes of `model` that read and write a `SlotKVCache`."""

    def __init__(self, model, max_positions: int):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"lean forward does not support this model: {reason}")
        self.model = model
        inner = model.model
        self.layers = list(inner.layers)
        attn = self.layers[0].self_attn
        cfg = model.config
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.vocab_size = inner.embed_tokens.weight.shape[0]
        self.dtype = inner.embed_tokens.weight.dtype
        with torch.no_grad():  # cos/sin of every position from the model's own rotary module
            cos, sin = inner.rotary_emb(inner.embed_tokens.weight[:1], torch.arange(max_positions)[None])
        cos, sin = rope_tables(cos[0].to(self.dtype), sin[0].to(self.dtype))  # [L, D]
        self.rope = torch.stack((cos, sin), dim=1)  # [L, 2, D]: one lookup per step gives both
        self.refresh()

    def refresh(self) -> None:
        """(Re)take the model's tensors: after parameters were replaced rather than copied into."""
        inner = self.model.model
        self.embed_w, self.norm_w = inner.embed_tokens.weight, inner.norm.weight
        self.norm_eps = inner.norm.variance_epsilon
        self.head_w, self.head_b = self.model.lm_head.weight, self.model.lm_head.bias
        with torch.no_grad():
            self.w = [_LayerWeights(layer, self.num_heads, self.num_kv_heads) for layer in self.layers]

    def check_weights(self) -> None:
        """Cheap per-step check that the packed buffers are still where the parameters live (a dtype or device
        move, `param.data = ...`): repack if not."""
        if not all(w.packed_valid() for w in self.w):
            self.refresh()

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, cache, first_slot: int) -> torch.Tensor:
        """Whole prompts from position 0: tokens [P, T] right-padded, lengths [P]; rows go to slots first_slot ..
        first_slot + P - 1. Returns logits [P, V] at each prompt's last token.

        Causal attention over the new keys alone is exact here: a row's padding sits after all its real tokens,
        so no real query sees it (padded queries see real keys and padding; their outputs are dropped)."""
        p, t = tokens.shape
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        positions = torch.arange(t)[None, :].expand(p, t)
        rope = self.rope[positions][:, :, :, None]  # [P, T, 2, 1, D]
        cos, sin = rope[:, :, 0], rope[:, :, 1]
        rows = cache_rows(torch.arange(first_slot, first_slot + p), positions, kvh, cache.length)
        x = F.embedding(tokens, self.embed_w)
        for w, k_cache, v_cache in zip(self.w, cache.k, cache.v):
            q, k, v = self._qkv(w, x, cos, sin)  # [P, T, heads, D]
            k_cache.view(-1, d).index_copy_(0, rows, k.reshape(-1, d))
            v_cache.view(-1, d).index_copy_(0, rows, v.reshape(-1, d))
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=True,
                scale=self.scaling,
                enable_gqa=h != kvh,
            ).transpose(1, 2)
            x = x + linear(o.reshape(p, t, h * d), w.o_w, w.o_b)
            x = x + self._mlp(w, x)
        return self._logits(x[torch.arange(p), (lengths - 1).clamp(min=0)])

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache, first_slot: int) -> torch.Tensor:
        """One new token per row: tokens [B] at positions [B] (= tokens already cached) of slots first_slot ..
        first_slot + B - 1. Returns logits [B, V].

        Attention runs as two batched matmuls over (row, KV head) pairs, the query heads that share a KV head
        being the rows of one small matrix: cheaper than SDPA's kernel at one query per sequence."""
        b = tokens.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        k_len = int(positions.max()) + 1
        mask = decode_mask(positions, kvh, k_len, self.dtype)
        rope = self.rope[positions][:, :, None]  # [B, 2, 1, D]
        cos, sin = rope[:, 0], rope[:, 1]
        rows = (cache.row_base(first_slot, b) + positions[:, None]).view(-1)
        x = F.embedding(tokens, self.embed_w)  # [B, H]
        for w, k_cache, v_cache in zip(self.w, cache.k, cache.v):
            q, k, v = self._qkv(w, x, cos, sin)  # [B, heads, D]
            k_cache.view(-1, d).index_copy_(0, rows, k.reshape(-1, d))
            v_cache.view(-1, d).index_copy_(0, rows, v.reshape(-1, d))
            keys = k_cache[first_slot : first_slot + b, :, :k_len].reshape(b * kvh, k_len, d)  # a view
            values = v_cache[first_slot : first_slot + b, :, :k_len].reshape(b * kvh, k_len, d)
            scores = torch.baddbmm(mask, q.reshape(b * kvh, h // kvh, d), keys.transpose(1, 2), alpha=self.scaling)
            o = torch.bmm(torch.softmax(scores, dim=-1), values).view(b, h * d)
            x = _add_linear(x, o, w.o_w, w.o_b)
            x = _add_linear(x, self._mlp_act(w, x), w.down_w, w.down_b)
        return self._logits(x)

    def _qkv(self, w: _LayerWeights, x, cos, sin):
        """Projections, Qwen3's per-head norm and RoPE for x [..., H]: q, k, v as [..., heads, D]."""
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = linear(rms_norm(x, w.ln1, w.eps1), w.qkv_w, w.qkv_b).view(*x.shape[:-1], h + 2 * kvh, d)
        qk, v = qkv[..., : h + kvh, :], qkv[..., h + kvh :, :]
        qk_w = w.qk_weight()
        if qk_w is not None:  # Qwen3: RMSNorm over each head's vector (q and k weights differ) before RoPE
            qk = rms_norm(qk, None, w.qk_eps) * qk_w
        qk = apply_rope(qk, cos, sin)
        return qk[..., :h, :], qk[..., h:, :], v

    def _mlp_act(self, w: _LayerWeights, x):
        gate, up = linear(rms_norm(x, w.ln2, w.eps2), w.gu_w, w.gu_b).chunk(2, dim=-1)
        return F.silu(gate) * up

    def _mlp(self, w: _LayerWeights, x):
        return linear(self._mlp_act(w, x), w.down_w, w.down_b)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return linear(rms_norm(x, self.norm_w, self.norm_eps), self.head_w, self.head_b)


def _add_linear(x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x + a @ weight.T (+ bias) for 2-D x: one addmm (the residual add rides in the matmul) where F.linear's
    kernel is the faster one (`linear`)."""
    if bias is not None or (_ONEDNN and weight.numel() >= ONEDNN_MIN_ELEMENTS):
        return x + linear(a, weight, bias)
    return torch.addmm(x, a, weight.t())

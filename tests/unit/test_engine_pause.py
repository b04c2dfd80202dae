"""The CPU engine's pause is entered and left by whichever server thread serves /pause and /resume."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from verifiers_rl.inference.cpu.cb_engine import CPUEngine
from verifiers_rl.models import get_model, get_tokenizer


def test_pause_and_resume_from_different_threads_then_close(tiny_model_dir):
    engine = CPUEngine(get_model(tiny_model_dir), get_tokenizer(tiny_model_dir), max_model_len=128, max_num_seqs=4)
    # two long-lived threads, like the server's worker pool: /pause lands on one, /resume on the other
    a, b = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
    try:
        a.submit(engine.pause).result(30)
        assert engine.is_paused
        b.submit(engine.pause).result(30)  # idempotent, from the other thread
        b.submit(engine.resume).result(30)
        assert not engine.is_paused
        # transformers refuses stop() from a thread it believes is inside a pause: close() on the thread that
        # paused used to raise, and the server hung on SIGTERM
        a.submit(engine.close).result(30)
        assert not engine.manager.is_running()
    finally:
        a.shutdown(), b.shutdown()
        if engine.manager.is_running():
            engine.resume()
            engine.manager.stop(block=True, timeout=10)

"""Provenance of the CPU counts in gpu_check_rehearsal.md: gpu_check's memory stage (the Qwen3-0.6B shape, its own
steps, _gpu_check_stages.train_steps: packed micro-batches, two a step, bf16 autocast, AdamW), run on the CPU with
every tensor storage counted from its creation to its release (tests/live_bytes.py, as
tests/unit/test_memory_measured.py counts), against plan.memory.rank_parts.

    .venv/bin/python benchmarks/results/gpu_check_memory_counted.py lora 4   # rows of 1024 tokens: 1, 2 or 4
    .venv/bin/python benchmarks/results/gpu_check_memory_counted.py full 2   # 4 rows need ~21 GB of RAM

Not CUDA: no caching-allocator rounding, and CPU kernels (SDPA's among them) may keep other temporaries.
"""

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]
from _gpu_check_stages import SAMPLE_LENGTHS, memory_setup, planner_estimate, train_steps  # noqa: E402
from live_bytes import LiveBytes  # noqa: E402


def main(use_lora: bool, rows: int) -> None:
    model, head, opt, cfg = memory_setup(use_lora, small=False, device="cpu")
    lengths = SAMPLE_LENGTHS[: {1: 1, 2: 3, 4: 7}[rows]]  # 1, 2 or 4 rows of 1024 tokens
    t0, count = time.time(), LiveBytes(model)
    with count:
        tokens = train_steps(model, head, opt, cfg.vocab_size, 1024, 2, lengths)  # the stage's own steps
    weights = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()]
    }
    peak = sum(weights.values()) + count.peak(leave_out=set())  # what existed before, and the step's own peak
    est = planner_estimate(cfg, use_lora, tokens, 1024)
    planner = est["total"] - est["cuda_context"]
    mib = {k: round(v / 2**20) for k, v in est.items()}
    what = f"{'lora' if use_lora else 'full'} {rows}x1024"
    print(f"{what}: planner {planner / 2**20:.0f} MiB, counted peak {peak / 2**20:.0f} MiB, ratio "
          f"{planner / peak:.2f}; parts {mib}; {time.time() - t0:.0f}s")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1] == "lora", int(sys.argv[2]))

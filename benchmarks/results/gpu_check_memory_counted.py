"""Provenance of the CPU counts in gpu_check_rehearsal.md: gpu_check's memory stage (the Qwen3-0.6B shape, its own
steps, _gpu_check_stages.train_steps: packed micro-batches, two a step, bf16 autocast, AdamW), run on the CPU with
every tensor storage counted from its creation to its release (the method of tests/unit/test_memory_measured.py;
CPU tensors have no allocator statistics), against plan.memory.rank_parts.

    .venv/bin/python benchmarks/results/gpu_check_memory_counted.py lora 4   # rows of 1024 tokens: 1, 2 or 4
    .venv/bin/python benchmarks/results/gpu_check_memory_counted.py full 2   # 4 rows need ~21 GB of RAM

Not CUDA: no caching-allocator rounding, and CPU kernels (SDPA's among them) may keep other temporaries.
"""

import sys
import time
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _gpu_check_stages import SAMPLE_LENGTHS, memory_setup, planner_estimate, train_steps  # noqa: E402


class Count(TorchDispatchMode):
    """Live bytes of the storages operators return while the mode is on (plus `track`ed ones), and their peak."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak, self.refs = {}, 0, 0, []

    def track(self, tensors) -> None:
        for t in tensors:
            self._add(t)

    def _add(self, t) -> None:
        if not isinstance(t, torch.Tensor):
            return
        storage = t.untyped_storage()
        key = id(storage)  # torch keeps one Python object per live storage
        if key in self.live or storage.nbytes() == 0:
            return
        self.live[key] = storage.nbytes()
        self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        self.refs.append(weakref.ref(storage, lambda _r, k=key: self._free(k)))

    def _free(self, key) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            self._add(t)
        return out


def main(use_lora: bool, rows: int) -> None:
    model, head, opt, cfg = memory_setup(use_lora, small=False, device="cpu")
    lengths = SAMPLE_LENGTHS[: {1: 1, 2: 3, 4: 7}[rows]]  # 1, 2 or 4 rows of 1024 tokens
    t0, count = time.time(), Count()
    count.track([*model.parameters(), *model.buffers()])
    with count:
        tokens = train_steps(model, head, opt, cfg.vocab_size, 1024, 2, lengths)  # the stage's own steps
    est = planner_estimate(cfg, use_lora, tokens, 1024)
    planner = est["total"] - est["cuda_context"]
    mib = {k: round(v / 2**20) for k, v in est.items()}
    what = f"{'lora' if use_lora else 'full'} {rows}x1024"
    print(f"{what}: planner {planner / 2**20:.0f} MiB, counted peak {count.peak / 2**20:.0f} MiB, ratio "
          f"{planner / count.peak:.2f}; parts {mib}; {time.time() - t0:.0f}s")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1] == "lora", int(sys.argv[2]))

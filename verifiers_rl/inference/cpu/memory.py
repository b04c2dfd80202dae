"""Memory for the weights a CPU engine streams once per decoded token: page-aligned, on transparent huge pages.

Batch-1 decode reads every weight byte per token, so it runs at the speed the cores stream memory. Two things
decide that speed besides the kernel (benchmarks/results/design_measurements.md#decode-weight-layout):

- where each weight starts: a weight whose rows begin mid-page (the dense parameter buffer puts Qwen3's 512-byte
  q/k norm vectors between layers, so most matrices started off a 4 KiB boundary) decodes slower than the same
  weights each starting on a page boundary (the cores' stream prefetchers stop at page boundaries, and a
  misaligned 4 KiB row crosses one);
- the page size: the same aligned weights on 2 MiB pages decode faster still (fewer TLB misses).

Linux backs anonymous memory with huge pages only where asked (`/sys/kernel/mm/transparent_hugepage/enabled`
is `madvise` on most distributions), and torch's allocator asks only under THP_MEM_ALLOC_ENABLE, read once per
process. So the engine allocates its weight buffer here and asks with `madvise(MADV_HUGEPAGE)` before the first
write; where that is not available (another OS, THP off) the buffer is an ordinary page-aligned one.
"""

from __future__ import annotations

import ctypes
import sys

import torch

PAGE = 4096
HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


def _madvise_huge(address: int, length: int) -> bool:
    if not sys.platform.startswith("linux") or length <= 0:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def weight_buffer(nbytes: int, *, huge: bool = True) -> tuple[torch.Tensor, bool]:
    """(an uninitialised uint8 tensor of `nbytes` starting on a page boundary, whether huge pages were asked for).

    Large enough buffers start on a 2 MiB boundary and are advised as huge pages; nothing has been written yet, so
    the first writes fault in huge pages directly (no later collapse by khugepaged needed)."""
    align = HUGE_PAGE if huge and nbytes >= HUGE_PAGE else PAGE
    raw = torch.empty(nbytes + align, dtype=torch.uint8)
    start = -raw.data_ptr() % align
    buf = raw[start : start + nbytes]
    advised = align == HUGE_PAGE and _madvise_huge(buf.data_ptr(), nbytes // HUGE_PAGE * HUGE_PAGE)
    return buf, advised


def page_aligned_offsets(sizes: list[int], min_aligned: int = 1 << 20) -> tuple[list[int], int]:
    """Byte offsets for tensors of `sizes` laid out in order in one buffer, and the buffer's size: a tensor of at
    least `min_aligned` bytes starts on a page boundary (what decode streams), smaller ones follow end to end
    (norm vectors, biases: padding them would cost more than they stream)."""
    offsets, end = [], 0
    for size in sizes:
        if size >= min_aligned:
            end = -(-end // PAGE) * PAGE
        offsets.append(end)
        end += size
    return offsets, end

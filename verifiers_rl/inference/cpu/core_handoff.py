"""The CPU engine's cores lent to training while the engine has nothing to generate.

With max_async_level >= 1 and our CPU engine on the trainer's machine, generation and training run at once, so
they split the cores (`plan/serving.py` `cpu_thread_split`: server s threads, trainer t). A step's generation
usually ends before its training does, and from then until the next sync starts the next batch, the server's
cores sit idle. The trainer takes them meanwhile: it widens to s + t threads once no rollout batch is in flight,
and narrows back to t once the sync has landed (the next batch starts generating right after it).

Where the switch happens: `torch.set_num_threads` sets the OpenMP team size of the calling thread only (libgomp
keeps it per thread), so the training thread must call it itself, between parallel regions. Hooks on every module
that holds weights of its own (linear layers, norms, embeddings, LoRA's A and B) ask before its forward and when
its output's gradient arrives in backward: a step of one micro-batch still widens mid-pass, at most one module's
work after generation ended (hooks on whole decoder layers came too late: on a 2-layer model the last one fires
mid-backward). Asking costs one Python call, and none once widened.

It shortens the step where generation ends well before training (bench_scaling's 128-token point, ~1.2x) and
leaves it alone where the two take about as long (benchmarks/results/design_measurements.md#core-handoff).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


class CoreHandoff:
    """Widen the training thread to `wide` threads while `generating()` is False; `narrow()` gives them back."""

    def __init__(self, narrow: int, wide: int, generating: Callable[[], bool]):
        if not 0 < narrow <= wide:
            raise ValueError(f"CoreHandoff needs 0 < narrow <= wide, got narrow={narrow}, wide={wide}")
        self.narrow_threads, self.wide_threads = narrow, wide
        self.generating = generating
        self.wide = False
        self._since = 0.0
        self._lent_s = 0.0
        self._handles: list = []

    def attach(self, model: torch.nn.Module) -> int:
        """Hook every module of `model` that holds parameters of its own (the model itself when none does);
        returns how many modules were hooked."""
        self.detach()
        layers = [m for m in model.modules() if next(m.parameters(recurse=False), None) is not None] or [model]
        for layer in layers:
            self._handles.append(layer.register_forward_pre_hook(self._on_forward))
            self._handles.append(layer.register_forward_hook(self._on_output))
        return len(layers)

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def widen_if_idle(self) -> None:
        if not self.wide and not self.generating():
            torch.set_num_threads(self.wide_threads)
            self.wide, self._since = True, time.perf_counter()

    def narrow(self) -> None:
        """Back to the trainer's share, on the thread that widened (the training thread)."""
        if self.wide:
            torch.set_num_threads(self.narrow_threads)
            self.wide = False
            self._lent_s += time.perf_counter() - self._since

    def take_lent_seconds(self) -> float:
        """Seconds trained on the lent cores since the last call (the step's `timing/lent_cores_s`)."""
        lent, self._lent_s = self._lent_s, 0.0
        if self.wide:
            now = time.perf_counter()
            lent, self._since = lent + now - self._since, now
        return lent

    def _on_forward(self, module, args) -> None:
        self.widen_if_idle()

    def _on_output(self, module, args, output) -> None:
        if self.wide:  # nothing left to ask until the sync narrows: no gradient hook for backward to run
            return
        out = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._on_grad)

    def _on_grad(self, grad: torch.Tensor) -> None:
        self.widen_if_idle()

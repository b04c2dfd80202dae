"""One sync's tensors as a stream: described up front (`metas`, in order), produced lazily in that order. A sender
plans its buckets before any tensor exists, then holds about one bucket at a time: a merged LoRA model is never
materialised whole, and a sharded model is gathered bucket by bucket (every rank iterates; only rank 0's stream
yields tensors). A yielded tensor may be a view of memory its producer reuses a few buckets later (a sharded
export's receive buffers): a consumer that keeps tensors beyond that copies them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from verifiers_rl.sync.buckets import Bucket, TensorMeta


@dataclass
class WeightStream:
    metas: list[TensorMeta]
    produce: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    peft_config: dict | None = None  # adapter sync: the adapter config the server installs the tensors with
    rank: int = 0  # adapter sync: the adapter's largest LoRA rank

    def __post_init__(self):
        self._live: Iterator | None = None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._live = self.produce()
        return self._live

    def drain(self) -> None:
        """Produce what is left of the stream and drop it: after a failed sync, the other ranks are waiting in a
        sharded model's collective (a stream never iterated was never opened to them: nothing to finish)."""
        it, self._live = self._live, None
        for _ in it or ():
            pass

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.metas)


def as_stream(named_tensors) -> WeightStream:
    """A WeightStream as it is; any other iterable of (name, tensor) pairs (`named_parameters()`, `AdapterWeights`)
    as it stands, with its peft config and rank when it has them."""
    if isinstance(named_tensors, WeightStream):
        return named_tensors
    items = [(n, t) for n, t in named_tensors]
    metas = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in items]
    config, rank = getattr(named_tensors, "peft_config", None), getattr(named_tensors, "rank", 0)
    return WeightStream(metas, lambda: iter(items), config, rank)


def bucket_tensors(
    buckets: list[Bucket], tensors: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[Bucket, list[torch.Tensor]]]:
    """Pair each bucket with its tensors, pulled as the bucket is reached; a tensor that is not the one the plan
    expects is an error, not a silently wrong sync."""
    it = iter(tensors)
    for bucket in buckets:
        out = []
        for meta in bucket.metas:
            try:
                name, t = next(it)
            except StopIteration:
                raise ValueError(f"the weight stream ended before {meta.name!r}") from None
            if name != meta.name or t.dtype != meta.dtype or tuple(t.shape) != meta.shape:
                raise ValueError(
                    f"the weight stream gave {name!r} {t.dtype}{tuple(t.shape)} where its description says "
                    f"{meta.name!r} {meta.dtype}{meta.shape}"
                )
            out.append(t)
        yield bucket, out

"""A slot KV cache: one rectangular [slots, kv_heads, length, head_dim] tensor per layer for keys and values.

Each running sequence owns one slot (a row). The engine keeps its running sequences in slots 0 .. n-1 (it moves
the last one into a freed row), so a decode step attends over the view `k[:n, :, :longest]`: no gather and no
block tables. Both dimensions start small and double on demand up to `max_slots` x `max_length` and a token
budget (slots x length), so a server configured for long contexts does not reserve that memory up front.
"""

from __future__ import annotations

import torch

LENGTH_QUANTUM = 64  # lengths are allocated in multiples of this
# What the cache may take when nobody says (SlotEngine's kv_cache_bytes): bounded in bytes, whatever the model.
# A token budget as a fraction of max_num_seqs x max_model_len (transformers' continuous-batching default, a
# quarter) capped a tiny model served at max_model_len 128 to 16 sequences of a 64-rollout batch (2048 tokens, a
# few MB), so decode ran in four waves (several times the decode steps per batch), while the same rule let a
# Qwen3-0.6B-sized model at the default 4096 claim ~15 GB.
DEFAULT_CACHE_BYTES = 4 << 30


def token_budget(cache_bytes: int, bytes_per_token: int, max_slots: int, max_length: int) -> int:
    """Tokens (slots x positions) the cache may hold: every slot at full length where that fits in cache_bytes,
    else what fits (SlotKVCache still keeps room for one full-length sequence)."""
    return max(1, min(max_slots * max_length, cache_bytes // max(1, bytes_per_token)))


def round_up(n: int, quantum: int) -> int:
    return -(-n // quantum) * quantum


class SlotKVCache:
    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        *,
        max_slots: int,
        max_length: int,
        budget_tokens: int | None = None,
        budget_bytes: int | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        self.num_layers, self.kv_heads, self.head_dim, self.dtype = num_layers, kv_heads, head_dim, dtype
        if budget_tokens is None and budget_bytes is not None:  # a token count wins where both are given
            budget_tokens = token_budget(budget_bytes, self.bytes_per_token, max_slots, max_length)
        self.max_slots, self.max_length = max_slots, round_up(max_length, LENGTH_QUANTUM)
        # Always room for one full-length sequence, whatever the budget.
        self.budget_tokens = max(self.max_length, budget_tokens or max_slots * self.max_length)
        self.slots, self.length = 0, 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._resize(min(4, max_slots), LENGTH_QUANTUM)

    @property
    def bytes_per_token(self) -> int:
        """Keys and values of one position in every layer."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def fits(self, slots: int, length: int) -> bool:
        """Whether `slots` sequences of up to `length` positions stay within the limits and the token budget."""
        length = round_up(length, LENGTH_QUANTUM)
        return slots <= self.max_slots and length <= self.max_length and slots * length <= self.budget_tokens

    def ensure(self, slots: int, length: int) -> None:
        """Make rows 0 .. slots-1 and positions 0 .. length-1 exist, keeping their contents.

        The caller promises nothing beyond those is in use: to stay within the budget, a reallocation may drop
        rows or positions past them. Growth doubles (fewer reallocations), as far as the budget allows."""
        if not self.fits(slots, length):
            raise ValueError(f"{slots} slots x {length} positions exceed the KV cache limits")
        length = round_up(length, LENGTH_QUANTUM)
        if slots <= self.slots and length <= self.length:
            return
        new_slots = max(slots, min(2 * self.slots if slots > self.slots else self.slots, self.max_slots))
        new_len = max(length, min(2 * self.length if length > self.length else self.length, self.max_length))
        budget = self.budget_tokens
        if new_slots * new_len > budget:  # give up the doubling of the length, then of the slots
            new_len = max(length, budget // new_slots // LENGTH_QUANTUM * LENGTH_QUANTUM)
        if new_slots * new_len > budget:
            new_slots = max(slots, budget // new_len)
        self._resize(new_slots, new_len)

    def _resize(self, slots: int, length: int) -> None:
        new_k, new_v = [], []
        for i in range(self.num_layers):
            # zeros, not empty: masked keys still enter the scores, and garbage could be NaN
            k = torch.zeros(slots, self.kv_heads, length, self.head_dim, dtype=self.dtype)
            v = torch.zeros_like(k)
            if self.k:
                s, n = min(slots, self.slots), min(length, self.length)
                k[:s, :, :n] = self.k[i][:s, :, :n]
                v[:s, :, :n] = self.v[i][:s, :, :n]
            new_k.append(k)
            new_v.append(v)
        self.k, self.v = new_k, new_v
        self.slots, self.length = slots, length
        # flat row of (slot, kv head, position 0) in a layer viewed as [slots * kv_heads * length, head_dim]
        self._row_base = (torch.arange(slots)[:, None] * self.kv_heads + torch.arange(self.kv_heads)) * length

    def row_base(self, first_slot: int, n: int) -> torch.Tensor:
        """[n, kv_heads] flat rows of position 0 for slots first_slot .. first_slot + n - 1 (add the position)."""
        return self._row_base[first_slot : first_slot + n]

    def copy(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot src into slot dst (compaction and prompt sharing)."""
        if src == dst or length <= 0:
            return
        for k, v in zip(self.k, self.v):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]

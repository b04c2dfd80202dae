"""The slot engine: our own continuous-batching loop over a slot KV cache, for Llama-family models on CPU.

One thread runs the loop. Each iteration admits waiting sequences into free slots (one batched prefill of the
distinct prompts; a sequence whose prompt is already cached, e.g. the other rollouts of a GRPO group or the
other choices of an n>1 request, copies that prompt's keys/values and logits instead), then advances every
running sequence by one token in one decode forward (`lean_forward.LeanDecoder`). Sampling is ours
(`sampling.process_logits`, then inverse-CDF sampling with each sequence's own uniform draws), so seeded results
do not depend on batch neighbours. Requests arrive from the server's event loop and get their results through
`call_soon_threadsafe`.

Compared with transformers' continuous batching (cb_engine.CPUEngine, still used for other architectures) this
drops its per-step scheduling, paged-cache bookkeeping and generic modeling code, which dominated on small
models. Failures stay local: a forward or sampling error retries the batch row by row and fails only the rows
that fail alone; a dead loop makes `healthy` false and new requests fail at once instead of hanging.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from dataclasses import dataclass, field

import torch

from verifiers_rl.inference.cpu.cb_engine import eos_ids
from verifiers_rl.inference.cpu.engine_api import DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_NUM_SEQS, EngineError
from verifiers_rl.inference.cpu.model.kv_cache import DEFAULT_CACHE_BYTES, SlotKVCache
from verifiers_rl.inference.cpu.model.lean_forward import LeanDecoder
from verifiers_rl.inference.cpu.sampling import (
    Completion,
    SamplingParams,
    UniformStream,
    check_prompt,
    find_stop,
    process_logits,
    request_generator,
    sample_inverse_cdf,
    stop_tail,
)
from verifiers_rl.inference.cpu.weights import ServedWeights

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Request:  # what the choices of one generate() call share
    params: SamplingParams
    prompt_ids: list[int]
    eos_ids: set[int]
    max_tokens: int
    policy_version: int
    loop: asyncio.AbstractEventLoop
    stop_tail: int


@dataclass(eq=False)
class _Seq:
    req: _Request
    future: asyncio.Future
    uniforms: UniformStream
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    slot: int = -1
    cached: int = 0  # positions of this sequence held in its slot
    done: bool = False


# Kept by bench_cpu_tunings' row "engine loop: transformers CB vs slots + lean forward" (>= 1.15x).
class SlotEngine(ServedWeights):
    """An `engine_api.ServingEngine`, like cb_engine.CPUEngine (the server cannot tell them apart)."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        kv_cache_tokens: int | None = None,
        kv_cache_bytes: int = DEFAULT_CACHE_BYTES,
        max_prefill_tokens: int = 8192,
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self._init_weights()
        self.flatten_parameters()  # one buffer in sync order: buckets arrive in place (weights.py)
        self.decoder = LeanDecoder(model, max_model_len)  # packs projections: adjacent spans of that buffer
        self.eos_token_ids = eos_ids(model, tokenizer)
        d = self.decoder
        self.cache = SlotKVCache(
            len(d.layers),
            d.num_kv_heads,
            d.head_dim,
            max_slots=max_num_seqs,
            max_length=max_model_len,
            budget_tokens=kv_cache_tokens or None,
            budget_bytes=kv_cache_bytes,
            dtype=d.dtype,
        )
        self._cond = threading.Condition()
        self._step_lock = threading.Lock()  # held for a whole step; pause() and load_weights() wait on it
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []  # index == slot
        self._shared: dict[tuple, tuple[_Seq, torch.Tensor]] = {}  # prompt -> (a running holder, its logits)
        self._paused = self._closed = False
        self._fatal: BaseException | None = None
        self.threads: int | None = None  # intra-op threads for the loop, set on its own thread (one OpenMP team each)
        self.loop_threads: int | None = None  # what the loop thread runs with, once `threads` was applied
        self._thread = threading.Thread(target=self._loop, name="vf-slot-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ requests (event loop)

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and self._fatal is None and not self._closed

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[Completion]:
        max_tokens = check_prompt(
            prompt_ids, params, vocab_size=self.decoder.vocab_size, max_model_len=self.max_model_len
        )
        if not self.healthy:
            raise EngineError(f"the generation loop is not running ({self._fatal!r})")
        loop = asyncio.get_running_loop()
        req = _Request(
            params=params,
            prompt_ids=list(prompt_ids),
            eos_ids=set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids),
            max_tokens=max_tokens,
            policy_version=self.version,
            loop=loop,
            stop_tail=stop_tail(params.stop),
        )
        streams = [UniformStream(request_generator(params.seed, i)) for i in range(params.n)]
        seqs = [_Seq(req, loop.create_future(), u) for u in streams]
        with self._cond:
            self._waiting.extend(seqs)
            self._cond.notify()
        try:
            return list(await asyncio.gather(*(s.future for s in seqs)))
        finally:
            for s in seqs:  # finished ones are done already; the others (client gone, a sibling failed) stop
                s.done = True

    def abort_all(self) -> int:
        """Fail every waiting and running request (vLLM's /pause?mode=abort)."""
        # between steps: mid-step, a sequence taken off the queue is in neither list until it has a slot
        locked = self._step_lock.acquire(timeout=30)
        try:
            with self._cond:
                seqs = list(self._waiting) + list(self._running)
                self._waiting.clear()
        finally:
            if locked:
                self._step_lock.release()
        live = [s for s in seqs if not s.done]
        for s in live:
            self._fail(s, EngineError("request aborted by /pause (mode=abort)"))
        return len(live)

    async def wait_idle(self, poll_s: float = 0.01) -> None:
        while any(not s.done for s in list(self._waiting) + list(self._running)):
            await asyncio.sleep(poll_s)

    # ------------------------------------------------------------------ control (any thread but the loop's)

    @property
    def is_paused(self) -> bool:
        return self._paused

    def pause(self) -> None:
        """Stop stepping after the current step (running sequences keep their slots and resume later)."""
        with self._cond:
            self._paused = True
        with self._step_lock:  # returns once the step in flight, if any, is over
            pass

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify()

    def load_weights(self, named_tensors, *, lora_scaling: float | None = None, write=None) -> int:
        with self._step_lock:  # never between two layers of a step
            n = super().load_weights(named_tensors, lora_scaling=lora_scaling, write=write)
            self._shared.clear()
            return n

    def placement(self, bucket):
        # called while the engine is paused for the sync (WeightReceiver.start): no step reads these weights
        with self._step_lock:
            self._shared.clear()
            return super().placement(bucket)

    def reset_prefix_cache(self) -> None:
        with self._step_lock:  # cached prompts hold keys/values computed with the old weights
            self._shared.clear()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        self.abort_all()

    # ------------------------------------------------------------------ the loop (its own thread)

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._closed and (self._paused or not (self._waiting or self._running)):
                        self._cond.wait()
                    if self._closed:
                        return
                if self.threads is not None and self.threads != self.loop_threads:
                    torch.set_num_threads(self.threads)
                    self.loop_threads = torch.get_num_threads()  # also fixes it: a later global change cannot
                with self._step_lock, torch.inference_mode():
                    if not self._paused:
                        self._step()
        except BaseException as e:  # a bug, not a bad request: say so, and fail fast from now on
            logger.exception("slot engine loop died")
            self._fatal = e
            with self._cond:
                seqs = list(self._waiting) + list(self._running)
                self._waiting.clear()
            for s in seqs:
                self._fail(s, EngineError(f"the generation loop died: {e!r}"))

    def _step(self) -> None:
        self.decoder.check_weights()
        self._compact()
        self._admit()
        self._compact()  # sequences that finished on their first token
        if self._running:
            self._decode()

    def _compact(self) -> None:
        """Drop finished sequences; move the ones in slots >= n into the freed slots < n (n = still running)."""
        if not any(s.done for s in self._running):
            return
        alive = [s for s in self._running if not s.done]
        n = len(alive)
        free = iter([i for i in range(n) if self._running[i].done])
        for s in alive:
            if s.slot >= n:
                dst = next(free)
                self.cache.copy(s.slot, dst, s.cached)
                s.slot = dst
        self._running = sorted(alive, key=lambda s: s.slot)
        self._shared = {k: v for k, v in self._shared.items() if not v[0].done}

    def _admit(self) -> None:
        batch: list[_Seq] = []
        need = max((s.cached + 1 for s in self._running), default=1)
        tokens = 0
        with self._cond:
            while self._waiting and len(self._running) + len(batch) < self.max_num_seqs:
                s = self._waiting[0]
                if s.done:
                    self._waiting.popleft()
                    continue
                n = len(s.req.prompt_ids) + len(s.tokens)
                if batch and tokens + n > self.max_prefill_tokens:
                    break
                if not self.cache.fits(len(self._running) + len(batch) + 1, max(need, n + 1)):
                    break
                batch.append(self._waiting.popleft())
                need, tokens = max(need, n + 1), tokens + n
        if not batch:
            return
        # One prefill per distinct prompt; followers copy its slot. Resumed (preempted) sequences prefill alone.
        sources, followers = [], []
        groups: dict = {}
        for s in batch:
            groups.setdefault(tuple(s.req.prompt_ids) if not s.tokens else s, []).append(s)
        for key, members in groups.items():
            held = self._shared.get(key) if isinstance(key, tuple) else None
            if held is not None and not held[0].done and held[0].slot >= 0:
                followers += [(s, held) for s in members]
            else:
                sources.append(members[0])
                followers += [(s, members[0]) for s in members[1:]]
        order = sources + [s for s, _ in followers]
        first = len(self._running)
        for i, s in enumerate(order):
            s.slot, s.cached = first + i, len(s.req.prompt_ids) + len(s.tokens)
        self.cache.ensure(first + len(order), max([need] + [s.cached for s in sources]))
        self._running += order
        rows: dict[_Seq, torch.Tensor] = {}
        self._isolated(sources, lambda ss: rows.update(zip(ss, self._prefill_rows(ss))))
        for s in sources:
            if s in rows and not s.tokens:
                self._shared[tuple(s.req.prompt_ids)] = (s, rows[s])
        for s, src in followers:
            holder, row = src if isinstance(src, tuple) else (src, rows.get(src))
            if row is None:
                self._fail(s, EngineError("generation failed: the prompt's prefill failed"))
                continue
            self.cache.copy(holder.slot, s.slot, s.cached)
            rows[s] = row
        ready = [s for s in order if s in rows and not s.done]
        self._isolated(ready, lambda ss: self._sample(ss, torch.stack([rows[s] for s in ss])))

    def _isolated(self, seqs: list[_Seq], run) -> None:
        """run(seqs) as a batch; if that raises, run([s]) for each alone and fail only the ones that raise. Every
        `run` here may be repeated: it rewrites the same cache positions and commits nothing before it ends."""
        if not seqs:
            return
        try:
            run(seqs)
        except Exception as e:  # noqa: BLE001 - one bad request must not take its batch down
            if len(seqs) == 1:
                self._fail(seqs[0], EngineError(f"generation failed: {e!r}"))
                return
            logger.warning("a batch of %d failed (%r); retrying request by request", len(seqs), e)
            for s in seqs:
                if not s.done:
                    self._isolated([s], run)

    def _prefill_rows(self, seqs: list[_Seq]) -> torch.Tensor:
        ids = [s.req.prompt_ids + s.tokens for s in seqs]
        tokens = torch.zeros(len(ids), max(len(x) for x in ids), dtype=torch.long)
        for i, x in enumerate(ids):
            tokens[i, : len(x)] = torch.tensor(x)
        return self.decoder.prefill(tokens, torch.tensor([len(x) for x in ids]), self.cache, seqs[0].slot)

    def _decode(self) -> None:
        need = max(s.cached for s in self._running) + 1
        while len(self._running) > 1 and not self.cache.fits(len(self._running), need):
            self._preempt()
            need = max(s.cached for s in self._running) + 1
        self.cache.ensure(len(self._running), need)
        self._isolated(list(self._running), self._decode_rows)

    def _decode_rows(self, seqs: list[_Seq]) -> None:
        # Idempotent until _sample succeeds: a retry rewrites the same cache positions.
        tokens = torch.tensor([s.tokens[-1] for s in seqs])
        positions = torch.tensor([s.cached for s in seqs])
        logits = self.decoder.decode(tokens, positions, self.cache, seqs[0].slot)
        for s in self._sample(seqs, logits):
            s.cached += 1

    def _preempt(self) -> None:
        """Send the sequence in the last slot back to the queue (its tokens and uniform draws kept); it is
        prefilled again, prompt and tokens, when room frees up."""
        s = self._running.pop()
        s.slot, s.cached = -1, 0
        self._shared = {k: v for k, v in self._shared.items() if v[0] is not s}
        with self._cond:
            self._waiting.appendleft(s)

    def _sample(self, seqs: list[_Seq], logits: torch.Tensor) -> list[_Seq]:
        params = [s.req.params for s in seqs]
        penalties = any(p.has_penalties for p in params)
        processed = process_logits(
            logits.float(),
            params,
            [s.req.prompt_ids for s in seqs] if penalties else None,
            [s.tokens for s in seqs] if penalties else None,
        )
        uniforms = torch.tensor([s.uniforms.next() for s in seqs])
        tokens, logprobs = sample_inverse_cdf(processed, [p.greedy for p in params], uniforms)
        for s, t, lp in zip(seqs, tokens.tolist(), logprobs.tolist()):  # nothing below raises to the batch
            s.tokens.append(t)
            s.logprobs.append(lp)
            try:
                self._check_finished(s)
            except Exception as e:  # noqa: BLE001 - e.g. a tokenizer error in stop-string matching
                self._fail(s, EngineError(f"generation failed: {e!r}"))
        return seqs

    def _check_finished(self, s: _Seq) -> None:
        req, last = s.req, s.tokens[-1]
        if s.done:
            return
        if req.params.stop:
            hit = find_stop(self.tokenizer, req.params.stop, req.params.skip_special_tokens, s.tokens, req.stop_tail)
            if hit is not None:
                n, stop = hit
                return self._finish(s, Completion(s.tokens[:n], s.logprobs[:n], "stop", stop, req.policy_version))
        if last in req.eos_ids:
            reason = last if last in req.params.stop_token_ids else None
            return self._finish(s, Completion(s.tokens, s.logprobs, "stop", reason, req.policy_version))
        if len(s.tokens) >= req.max_tokens:
            return self._finish(s, Completion(s.tokens, s.logprobs, "length", None, req.policy_version))

    def _finish(self, s: _Seq, result) -> None:
        s.done = True
        try:
            s.req.loop.call_soon_threadsafe(_settle, s.future, result)
        except RuntimeError:  # the caller's event loop is gone
            pass

    _fail = _finish  # an exception as the result


def _settle(future: asyncio.Future, result) -> None:
    if not future.done():
        (future.set_exception if isinstance(result, BaseException) else future.set_result)(result)

"""The CPU engine: transformers continuous batching with our sampler, plus in-place weight updates.

Concurrent requests share batches and the paged KV cache (transformers' ContinuousBatchingManager). The
manager's own sampler has no per-request seed, min-p or penalties, so we replace the model runner's sampling
step with `sampling.process_logits` + `sampling.sample`; rows map to the batch's requests in order.
That hook reads two internals (`inputs_and_outputs.requests_in_batch`, `FutureRequestState.has_new_token`),
checked at start-up so a transformers upgrade fails loudly instead of sampling wrongly.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from dataclasses import dataclass, field

import torch

from verifiers_rl.inference.cpu.engine_api import DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_NUM_SEQS, EngineError
from verifiers_rl.inference.cpu.sampling import (
    Completion,
    SamplingParams,
    check_prompt,
    find_stop,
    process_logits,
    request_generator,
    sample_inverse_cdf,
    stop_tail,
)
from verifiers_rl.inference.cpu.weights import ServedWeights


@dataclass
class _Request:
    params: SamplingParams
    prompt_ids: list[int]
    generator: torch.Generator | None
    eos_ids: set[int]
    policy_version: int
    future: asyncio.Future | None = None
    loop: asyncio.AbstractEventLoop | None = None
    stop_tail: int = 0
    done: bool = field(default=False)


_RETIRED = _Request(SamplingParams(temperature=0.0), [], None, set(), 0, done=True)


class CPUEngine(ServedWeights):
    """transformers' continuous batching as an `engine_api.ServingEngine` (architectures the slot engine does not
    cover)."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_batch_tokens: int | None = None,
        page_size: int = 64,
        num_blocks: int | None = None,
        attention: str = "varlen",
    ):
        from transformers import ContinuousBatchingConfig, GenerationConfig

        if attention not in ("varlen", "sdpa"):
            raise ValueError(f"attention={attention!r}; allowed: 'varlen', 'sdpa'")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._init_weights()
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._pause_holder: _PauseHolder | None = None
        self.eos_token_ids = eos_ids(model, tokenizer)

        blocks = num_blocks or max(16, (max_num_seqs * max_model_len) // page_size // 4)
        cb_config = ContinuousBatchingConfig(
            return_logprobs=True,
            page_size=page_size,
            num_blocks=blocks,
            max_batch_tokens=max_batch_tokens or max(256, min(4096, max_model_len)),
            max_requests_per_batch=max_num_seqs,
            allow_block_sharing=True,
            use_cuda_graph=False,
            use_async_batching=False,
        )
        # Greedy, no processors: the manager must hand raw logits to our sampling hook.
        gen_config = GenerationConfig(
            do_sample=False, max_new_tokens=max_model_len, eos_token_id=sorted(self.eos_token_ids) or -1
        )
        self.manager = model.init_continuous_batching(gen_config, cb_config)
        if attention == "varlen":  # per-request attention instead of one block-diagonal mask over the whole batch
            from verifiers_rl.inference.cpu.model.varlen_attention import install

            install(model)
        self.manager.warmup()  # creates the batch processor so the hook is in place before the first batch
        runner = self.manager.batch_processor.model_runner
        if runner.logit_processor.do_processing or not hasattr(runner, "_sample"):
            raise EngineError("unsupported transformers continuous-batching layout; use transformers==5.23.x")
        runner._sample = self._sample_hook
        self._runner = runner
        self.manager.start()

    # ------------------------------------------------------------------ sampling (generation thread)

    def _sample_hook(self, scores: torch.Tensor, output_ids: torch.Tensor) -> None:
        futures = self._runner.inputs_and_outputs.requests_in_batch
        states = [f.state for f in futures if f.has_new_token]
        # Rows follow the requests that get a token this step, in batch order; rows past them are padding
        # for requests still mid-prefill.
        if scores.shape[1] < len(states):
            raise EngineError(f"sampling hook saw {scores.shape[1]} rows for {len(states)} requests")
        logits = scores[0, : len(states)]
        # A request cancelled after a stop string can still sit in this batch; sample it greedily and discard.
        reqs = [self._requests.get(s.request_id, _RETIRED) for s in states]
        outputs = [(s.initial_tokens + s.generated_tokens)[len(r.prompt_ids) :] for s, r in zip(states, reqs)]
        params = [r.params for r in reqs]
        processed = process_logits(logits, params, [r.prompt_ids for r in reqs], outputs)
        # one uniform per row (V exponential draws per row cost ~4.5 ms each at a 152k vocabulary)
        uniforms = torch.cat([torch.rand(1, generator=r.generator, dtype=torch.float64) for r in reqs])
        tokens, logprobs = sample_inverse_cdf(processed, [p.greedy for p in params], uniforms)
        n = tokens.shape[0]
        output_ids[0, :n].copy_(tokens)
        output_ids[1, :n].copy_(logprobs.float().view(torch.int32))

    # ------------------------------------------------------------------ requests (event loop)

    @property
    def healthy(self) -> bool:
        return self.manager.is_running()

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[Completion]:
        vocab = self.model.get_input_embeddings().weight.shape[0]
        max_tokens = check_prompt(prompt_ids, params, vocab_size=vocab, max_model_len=self.max_model_len)
        if not self.healthy:
            raise EngineError("the continuous-batching loop is not running")
        eos = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        loop = asyncio.get_running_loop()
        base = f"r{next(self._ids)}"
        futures = []
        for i in range(params.n):
            rid = f"{base}-{i}"
            req = _Request(
                params=params,
                prompt_ids=list(prompt_ids),
                generator=request_generator(params.seed, i),
                eos_ids=eos,
                policy_version=self.version,
                future=loop.create_future(),
                loop=loop,
                stop_tail=stop_tail(params.stop),
            )
            self._requests[rid] = req
            futures.append(req.future)
            self.manager.register_result_handler(rid, lambda out, rid=rid: self._on_output(rid, out))
            self.manager.add_request(
                list(prompt_ids),
                request_id=rid,
                max_new_tokens=max_tokens,
                streaming=bool(params.stop),
                eos_token_id=sorted(eos) or -1,
            )
        try:
            return list(await asyncio.gather(*futures))
        finally:
            for i in range(params.n):
                rid = f"{base}-{i}"
                req = self._requests.pop(rid, None)
                if req is not None and not req.done:  # client went away: free the batch slot
                    self.manager.cancel_request(rid)

    def _on_output(self, rid: str, out) -> None:
        req = self._requests.get(rid)
        if req is None or req.done:
            return
        if out.error is not None:
            req.done = True
            req.future.set_exception(EngineError(f"generation failed: {out.error}"))
            return
        tokens, logprobs = list(out.generated_tokens), list(out.logprobs)
        if req.params.stop:
            hit = find_stop(self.tokenizer, req.params.stop, req.params.skip_special_tokens, tokens, req.stop_tail)
            if hit is not None:
                n_tokens, stop = hit
                req.done = True
                self.manager.cancel_request(rid)
                req.future.set_result(
                    Completion(tokens[:n_tokens], logprobs[:n_tokens], "stop", stop, req.policy_version)
                )
                return
        if not out.is_finished():
            return
        req.done = True
        last = tokens[-1] if tokens else None
        if last is not None and last in req.eos_ids:
            finish, reason = "stop", (last if last in req.params.stop_token_ids else None)
        else:
            finish, reason = "length", None
        req.future.set_result(Completion(tokens, logprobs, finish, reason, req.policy_version))

    def abort_all(self) -> int:
        """Cancel every in-flight request (vLLM's /pause?mode=abort); their callers get an EngineError."""
        aborted = 0
        for rid, req in list(self._requests.items()):
            if req.done:
                continue
            req.done = True
            self.manager.cancel_request(rid)
            req.loop.call_soon_threadsafe(_fail, req.future, EngineError("request aborted by /pause (mode=abort)"))
            aborted += 1
        return aborted

    async def wait_idle(self, poll_s: float = 0.01) -> None:
        while any(not r.done for r in self._requests.values()):
            await asyncio.sleep(poll_s)

    # ------------------------------------------------------------------ weights (any thread but the loop's)

    @property
    def is_paused(self) -> bool:
        return self._pause_holder is not None

    def pause(self) -> None:
        """Stop scheduling batches (in-flight requests keep their cache and resume later)."""
        with self._lock:
            if self._pause_holder is None:
                self._pause_holder = _PauseHolder(self.manager)

    def resume(self) -> None:
        with self._lock:
            if self._pause_holder is not None:
                self._pause_holder.release()
                self._pause_holder = None

    def reset_prefix_cache(self) -> None:
        # Blocks cached for prefix sharing hold keys/values computed with the old weights.
        bp = self.manager.batch_processor
        if bp is not None:
            with self.manager.pause() if not self.is_paused else contextlib.nullcontext():
                bp.cache.evict_cached_blocks()

    def close(self) -> None:
        self.resume()
        if self.manager.is_running():
            self.manager.stop(block=True, timeout=10)


class _PauseHolder:
    """Holds `manager.pause()` on a thread of its own between /pause and /resume.

    transformers counts pauses per thread and refuses `stop()` from a thread it believes is inside a pause. The
    server enters and leaves pauses from whichever handler thread serves /pause and /resume, so entering and
    leaving on different threads left a stale count behind and shutdown raised (and hung on SIGTERM)."""

    def __init__(self, manager):
        self._entered, self._release = threading.Event(), threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._hold, args=(manager,), name="vf-engine-pause", daemon=True)
        self._thread.start()
        self._entered.wait()
        if self._error is not None:
            raise self._error

    def _hold(self, manager) -> None:
        try:
            with manager.pause():
                self._entered.set()
                self._release.wait()
        except BaseException as e:  # noqa: BLE001 - handed to the thread that asked for the pause
            self._error = e
            self._entered.set()

    def release(self) -> None:
        self._release.set()
        self._thread.join()


def _fail(future: asyncio.Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)


def eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        v = getattr(src, "eos_token_id", None)
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    return {i for i in ids if i >= 0}

"""Orchestrator: grouped rollouts generated ahead of training, on one background event loop.

Batch b holds prompts [b*P, (b+1)*P) of an endless stream of seeded per-epoch permutations of the dataset,
each repeated `rollouts_per_example` times (with difficulty filtering, Q = ceil(P * oversampling_factor) prompts
instead of P: difficulty_filter.py). Because a batch is a pure function of its index, the data cursor is just the
index of the next batch to train, and every rollout gets a seed derived from (seed, batch, prompt, rollout, turn):
the same checkpoint resumes to the same samples.

One thread owns one long-lived event loop and one HTTP client (verifiers' `generate_sync` opens and closes a
loop per call, which breaks a reused client). Up to `max_async_level` batches generate while the trainer
trains; a failure comes back to the trainer as an exception from `get()`, never as a silent hang. With a
`RolloutProcess` the environment's code runs in a child; what a batch is made of is decided here either way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import numpy as np
from openai import AsyncOpenAI

from verifiers_rl.rollouts.client import ROLLOUT_KEY, RolloutClient, rollout_seed  # noqa: F401 - public here
from verifiers_rl.rollouts.difficulty_filter import DifficultyFilter
from verifiers_rl.rollouts.env_mix import MixedRows, env_name_of
from verifiers_rl.rollouts.process import (
    ProcessExited,
    ProcessUnavailable,
    RolloutProcess,
    generate,
    type_name,
    where,
)
from verifiers_rl.rollouts.rollouts import Rollout, rollouts_from_outputs
from verifiers_rl.rollouts.stages import stages_of, stuck_message
from verifiers_rl.serving.recovery import quiet_lost_requests
from verifiers_rl.sync.policy_sync import PolicyVersion

logger = logging.getLogger(__name__)


class GenerationError(RuntimeError):
    """Rollout generation failed; the message carries the environment's or server's error. `stage`: where a batch
    that did not finish was stuck ("generation" is the server's part; stages.py)."""

    def __init__(self, message: str, timed_out: bool = False, stage: str | None = None):
        super().__init__(message)
        self.timed_out = timed_out
        self.stage = stage


@dataclass
class RolloutBatch:
    index: int
    rollouts: list[Rollout]
    policy_version: int  # the version served when the batch started
    generation_seconds: float
    filter_metrics: dict[str, float] | None = None  # difficulty filtering: what was generated, dropped, kept


def expand_groups(rows: list[dict], group_size: int, tag: str) -> tuple[list[dict], list[int]]:
    """Each row repeated `group_size` times (one group per row), each copy keyed `<tag>:<row>:<copy>` for its
    sampling seed; returns (inputs, group index of each input)."""
    inputs, groups = [], []
    for j, row in enumerate(rows):
        for r in range(group_size):
            inputs.append({**row, ROLLOUT_KEY: f"{tag}:{j}:{r}"})
            groups.append(j)
    return inputs, groups


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def batch_rows(index: int, prompts_per_batch: int, dataset_len: int, seed: int, shuffle: bool) -> list[int]:
    """Dataset rows of batch `index`: a slice of the endless concatenation of per-epoch permutations."""
    start = index * prompts_per_batch
    rows = []
    for pos in range(start, start + prompts_per_batch):
        epoch, i = divmod(pos, dataset_len)
        rows.append(int(_epoch_order(seed, epoch, dataset_len)[i]) if shuffle else i)
    return rows


class Orchestrator:
    def __init__(
        self,
        env,
        dataset,
        *,
        base_url: str,
        model_name: str,
        sampling_args: dict[str, Any],
        rollouts_per_example: int,
        prompts_per_batch: int,
        max_concurrent: int = 1024,
        generation_timeout: float = 600.0,
        seed: int | None = 0,
        shuffle: bool = True,
        api_key: str = "EMPTY",
        policy_version: PolicyVersion | None = None,
        max_async_level: int = 0,
        scoring_timeout: float | None = None,
        steps_per_batch: int = 1,
        process: RolloutProcess | None = None,
        difficulty_filter: DifficultyFilter | None = None,
    ):
        if len(dataset) == 0:
            raise ValueError("the training dataset is empty (after filtering over-long prompts)")
        self.env, self.dataset = env, dataset
        self.base_url, self.model_name, self.api_key = base_url, model_name, api_key
        self.sampling_args = sampling_args
        self.group_size, self.prompts_per_batch = rollouts_per_example, prompts_per_batch
        self.max_concurrent, self.timeout = max_concurrent, generation_timeout
        self.seed, self.shuffle = seed if seed is not None else 0, shuffle
        self.policy_version = policy_version or PolicyVersion(0)
        self.max_async_level = max_async_level
        self.steps_per_batch = steps_per_batch  # num_iterations: batch b is first trained at step b * this
        self.scoring_timeout = scoring_timeout
        self.filter = difficulty_filter  # None: every group drawn is trained
        self.prompts_drawn = difficulty_filter.drawn if difficulty_filter else prompts_per_batch
        self.mix = MixedRows.of(env, dataset)  # several environments: each batch mixed by their ratios
        self.process = process  # rollouts in a child process (process.py); None: on this loop
        self.stages = process.stages if process is not None else stages_of(env)
        quiet_lost_requests(env)
        self._required: dict[int, int] = {}  # batch index -> the policy version it must be generated with
        self._futures: dict[int, Future] = {}
        self._ready: dict[int, RolloutBatch] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: RolloutClient | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._thread is not None:
            return
        started = threading.Event()

        def run():
            self._loop = asyncio.new_event_loop()
            self._loop.set_exception_handler(_quiet_unretrieved)
            asyncio.set_event_loop(self._loop)
            self._client = self._new_client()  # also the fallback of a rollout process that could not load the env
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="vf-rl-orchestrator", daemon=True)
        self._thread.start()
        started.wait()
        self._connect_process()

    def _connect_process(self) -> None:
        if self.process is not None:
            self.process.connect(
                self.base_url, self.model_name, self.api_key, self.timeout, self.seed, self.max_concurrent
            )

    def close(self) -> None:
        for fut in self._futures.values():
            fut.cancel()
        self._futures.clear()
        if self._loop is not None and self._thread is not None:
            # a loop held by environment code that never returns (a blocking call in a reward function) answers
            # nothing: then nothing is waited for (the thread is a daemon and dies with the process)
            alive = self._responsive(1.0)
            if self._client is not None and alive:
                # bounded: requests to a frozen server must not keep a closing trainer alive
                with contextlib.suppress(Exception):
                    asyncio.run_coroutine_threadsafe(self._client.close(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5 if alive else 0.1)
        self._thread = self._loop = self._client = None
        if self.process is not None:
            self.process.close()
            self.process = None

    def _responsive(self, timeout: float) -> bool:
        answered = threading.Event()
        self._loop.call_soon_threadsafe(answered.set)
        return answered.wait(timeout)

    def _new_client(self) -> RolloutClient:
        """A client with an HTTP session of its own (made on the orchestrator's loop)."""
        return RolloutClient(
            AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0, timeout=self.timeout),
            self.seed,
            stages=self.stages,
        )

    def discard_unfinished(self) -> None:
        """The server they ran against is gone: cancel batches in flight and drop finished ones that hold an
        errored rollout (they may have lost requests), so that they are generated again."""
        for fut in self._futures.values():
            fut.cancel()
        self._futures.clear()
        for index, batch in list(self._ready.items()):
            if any(r.error_kind == "errored" for r in batch.rollouts):
                del self._ready[index]

    def reconnect(self, base_url: str, model_name: str | None = None) -> None:
        """Talk to a new server (or the same address again): a fresh HTTP session, none of the dead one's
        connections."""
        self.base_url = base_url
        self.model_name = model_name or self.model_name
        if self._loop is None:
            return
        self._connect_process()
        old = self._client

        async def swap():
            self._client = self._new_client()
            if old is not None:
                with contextlib.suppress(Exception):
                    await old.close()

        asyncio.run_coroutine_threadsafe(swap(), self._loop).result(30)

    # ------------------------------------------------------------------ batches

    def inputs_for(self, index: int) -> tuple[list[dict], list[int]]:
        if self.mix is not None:
            rows = self.mix.batch(index, self.prompts_drawn, self.seed, self.shuffle)
        else:
            rows = batch_rows(index, self.prompts_drawn, len(self.dataset), self.seed, self.shuffle)
        return expand_groups([_row(self.dataset, i) for i in rows], self.group_size, str(index))

    def required_version(self, index: int) -> int:
        """Batch b, first trained at step s = b * steps_per_batch, is generated by policy version max(0, s - k):
        what it is made of never depends on timing."""
        return max(0, index * self.steps_per_batch - self.max_async_level)

    def submit(self, index: int) -> None:
        if index in self._futures or index in self._ready:
            return
        self.start()
        required = self._required[index] = self.required_version(index)
        coro = self._generate(index, required)
        self._futures[index] = asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _generate(self, index: int, required: int) -> RolloutBatch:
        # Waits for the version it needs; the trainer, in turn, syncs a newer version only once every batch that
        # needs an older one has finished (`wait_for_batches_before`): no sync lands inside a batch.
        while not self.policy_version.reached(required):
            await asyncio.sleep(0.005)
        version = self.policy_version.value
        inputs, groups = self.inputs_for(index)
        t0 = time.perf_counter()
        out = await self._run(inputs, self.sampling_args)
        rollouts, kept = _tagged(rollouts_from_outputs(out["outputs"], groups, version), inputs), None
        if self.filter is not None:
            rollouts, kept = self.filter.select(rollouts)
        return RolloutBatch(index, rollouts, version, time.perf_counter() - t0, kept)

    def wait_for_batches_before(self, version: int, timeout: float | None = None) -> None:
        """Block until every submitted batch that must be generated by a version older than `version` is done,
        so that syncing `version` now cannot change the weights under any of them."""
        older = [fut for index, fut in self._futures.items() if self._required.get(index, 0) < version]
        if older:
            concurrent.futures.wait(older, timeout=timeout if timeout is not None else self.timeout)

    async def _run(self, inputs: list[dict], sampling_args: dict) -> dict:
        process = self.process
        if process is not None:
            try:
                await process.check_once(lambda: self.inputs_for(0)[0][0], self.env, self._client, self.model_name)
                return await process.generate(inputs, sampling_args)
            except ProcessUnavailable as e:
                self._without_process(process, str(e))
        return await generate(self.env, inputs, self._client, self.model_name, sampling_args, self.max_concurrent)

    def _without_process(self, process: RolloutProcess, why: str) -> None:
        """The environment's code cannot run in the rollout process: generate here, as without one (once said)."""
        if self.process is not process:
            return
        logger.warning("rollouts run in the trainer's process: %s", why)
        self.process = None
        self.stages = stages_of(self.env)
        process.close()

    def get(self, index: int) -> RolloutBatch:
        """The batch `index`, waiting for it if needed (submitting it first if nobody did)."""
        if index in self._ready:
            return self._ready.pop(index)
        self.submit(index)
        fut = self._futures[index]
        try:
            batch = self._wait(fut, f"rollout batch {index}")
        except GenerationError:
            raise
        except ProcessExited as e:
            raise GenerationError(f"rollout batch {index} failed: {e}") from None
        except Exception as e:  # noqa: BLE001 - re-raised with context for the training loop
            raise GenerationError(
                f"rollout batch {index} failed: the environment raised {type_name(e)}: {e}{where(e)}"
            ) from e
        finally:
            if fut.done():
                self._futures.pop(index, None)
        return batch

    def _wait(self, fut: Future, what: str):
        """`fut`'s result within generation_timeout, watching the stages meanwhile: a reward function past
        scoring_timeout stops the wait at once, and a timeout says which stage is stuck, in which function."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return fut.result(timeout=max(min(1.0, deadline - time.monotonic()), 0.0))
            except FutureTimeout:
                pass
            if self.scoring_timeout is not None:
                late = self.stages.overdue("scoring", self.scoring_timeout)
                if late is not None:
                    _, where = stuck_message(self.stages, culprit=late)
                    raise GenerationError(
                        f"{what}: {late.name} did not return within scoring_timeout={self.scoring_timeout:.0f}s "
                        f"({where}); fix the function or raise scoring_timeout",
                        timed_out=True,
                        stage="scoring",
                    ) from None
            if time.monotonic() >= deadline:
                stage, where = stuck_message(self.stages)
                hint = "check the inference server log, or raise generation_timeout / lower batch_size"
                if stage not in (None, "generation"):
                    hint = "the stage named is where the environment's own code did not return"
                raise GenerationError(
                    f"{what} did not finish within generation_timeout={self.timeout:.0f}s: {where}; {hint}",
                    timed_out=True,
                    stage=stage,
                ) from None

    def pending(self) -> list[int]:
        return sorted(set(self._futures) | set(self._ready))

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self, timeout: float | None = None) -> dict:
        """Finish in-flight batches and keep them: after a resume they are trained exactly as they would have been.

        With `timeout` (a save on a signal), batches still generating after that many seconds are left out; a
        resumed run generates them again, with the policy it resumes with."""
        deadline = None if timeout is None else time.monotonic() + timeout
        ready = dict(self._ready)
        for index in sorted(self._futures):
            fut = self._futures[index]
            if deadline is not None:
                try:
                    fut.result(timeout=max(deadline - time.monotonic(), 0.0))
                except Exception:  # noqa: BLE001 - unfinished or failed: regenerated after the resume
                    continue
            ready[index] = self.get(index)
        self._ready = dict(ready)
        return {"ready": ready}

    def load_state_dict(self, state: dict) -> None:
        self._ready.update(state.get("ready", {}))

    # ------------------------------------------------------------------ eval

    def evaluate(self, dataset, rollouts_per_example: int, sampling_args: dict) -> list[Rollout]:
        self.start()
        rows = [_row(dataset, j) for j in range(len(dataset))]
        inputs, groups = expand_groups(rows, rollouts_per_example, "eval")
        version = self.policy_version.value or 0  # evaluate() syncs first; a bare orchestrator serves version 0
        fut = asyncio.run_coroutine_threadsafe(self._run(inputs, sampling_args), self._loop)
        try:
            out = self._wait(fut, "evaluation rollouts")
        except GenerationError:
            fut.cancel()
            raise
        except Exception as e:  # noqa: BLE001
            raise GenerationError(f"evaluation rollouts failed: {type_name(e)}: {e}{where(e)}") from e
        return _tagged(rollouts_from_outputs(out["outputs"], groups, version), inputs)


def _tagged(rollouts: list[Rollout], inputs: list[dict]) -> list[Rollout]:
    """Each rollout named by the environment its input routes to (an EnvGroup's rows; None otherwise), for the
    per-environment metrics. Rollouts come in the order of their inputs."""
    for rollout, row in zip(rollouts, inputs):
        rollout.env = env_name_of(row)
    return rollouts


def _row(dataset, i: int) -> dict:
    row = dict(dataset[i])
    row.setdefault("example_id", i)
    return row


def _quiet_unretrieved(loop, context) -> None:
    # When one rollout raises, env.generate's gather fails and its sibling tasks' exceptions are never
    # retrieved; asyncio would print each as a traceback. The first failure is what GenerationError reports.
    if "exception was never retrieved" in str(context.get("message", "")):
        return
    loop.default_exception_handler(context)

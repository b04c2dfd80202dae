"""Rollouts in a process of their own: the environment's code, its reward functions and the HTTP client run in a
child interpreter, so they do not take the trainer's GIL while it trains (`RLConfig.rollout_process`).

Why a process and not the orchestrator's thread: on a CPU-bound trainer the rollout code (verifiers' per-call
bookkeeping, parsing, reward functions) and the training step take turns on one GIL; in a process of their own the
training step is shorter and the async step comes closer to its bound
(benchmarks/results/design_measurements.md#rollout-process). The trainer keeps everything that decides *what* is
generated (batch indices, policy versions, the no-sync-inside-a-batch rule, checkpoints); the child only runs
`env.generate` on the inputs it is sent and sends back the parts of each output the trainer reads.

The environment object crosses with dill (verifiers' parsers hold lambdas, and a notebook's reward functions live
in `__main__`, neither of which the standard pickle takes). A function of the user's `__main__` crosses by value,
and the globals it reads (the script's imports, helpers, constants, compiled patterns, classes) cross with it into
the child's own `__main__` (main_copies.py). An environment that cannot be copied, or that fails to load in the
child, is generated in the trainer's process as before, with a log line saying why; so is one whose reward
functions fail in the child on the first training example but not in the trainer's process (reward_probe.py: run
there first, here only when it found a failure). The child's side is child.py. Protocol, over a socket
pair with `multiprocessing.connection` framing (pickled tuples):

    trainer -> child: ("init", sys_path, env_bytes) ("connect", base_url, model, api_key, timeout, seed,
                      max_concurrent) ("generate", id, inputs, sampling_args) ("check", id, input) ("cancel", id)
                      ("close",)
    child -> trainer: ("ready",) ("failed", why) ("done", id, outputs | failures) ("error", id, type, message, where)
                      ("stages", [(stage, function, since), ...])

The child is a `python -c` subprocess, not a multiprocessing "spawn" one: spawn re-runs the user's `__main__`,
which for a training script without a main guard would start a second training run. It ignores SIGINT/SIGTERM
(the trainer decides when rollouts stop: a signal saves a checkpoint first) and exits when its socket closes, so it
never outlives the trainer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import traceback
from multiprocessing.connection import Connection

from verifiers_rl.rollouts.main_copies import copy_of
from verifiers_rl.rollouts.reward_probe import only_in_child, reward_failures
from verifiers_rl.rollouts.rollouts import POLICY_VERSIONS_KEY, REWARD_ERRORS_KEY
from verifiers_rl.rollouts.stages import Stages

logger = logging.getLogger(__name__)

STATE_COLUMNS = ["trajectory", POLICY_VERSIONS_KEY, "prompt_too_long", REWARD_ERRORS_KEY]


# `-c`: the child's `__main__` is a namespace of its own, which main_copies.load_copy fills with the user's globals
_CHILD = "from verifiers_rl.rollouts.child import main; main()"


class ProcessUnavailable(RuntimeError):
    """The environment did not load in the rollout process: rollouts go back to the trainer's process."""


class ProcessExited(RuntimeError):
    """The rollout process is gone (killed, crashed, or closed): the batches it held are lost."""


class EnvironmentRaised(Exception):
    """An exception the environment raised in the rollout process, with its type's name and the frame it came
    from (the exception object itself may not pickle)."""

    def __init__(self, type_name: str, message: str, where: str):
        super().__init__(message)
        self.type_name, self.where = type_name, where


def where(error: BaseException) -> str:
    """`in <function> (<file>:<line>)` of the innermost frame that raised: the environment's own code."""
    if isinstance(error, EnvironmentRaised):
        return error.where
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    return f" in {last.name} ({os.path.basename(last.filename)}:{last.lineno})"


def type_name(error: BaseException) -> str:
    return error.type_name if isinstance(error, EnvironmentRaised) else type(error).__name__


async def generate(env, inputs: list[dict], client, model: str, sampling_args: dict, max_concurrent: int) -> dict:
    """verifiers' `env.generate` as both the child and the orchestrator's thread call it."""
    quiet = lambda *a, **k: None  # noqa: E731 - the trainer draws its own progress bar
    return await env.generate(
        inputs,
        client,
        model,
        sampling_args=sampling_args,
        max_concurrent=max_concurrent,
        state_columns=STATE_COLUMNS,
        on_start=quiet,
        on_progress=quiet,
    )


def trim_outputs(outputs: list[dict]) -> list[dict]:
    """What `rollouts_from_outputs` reads of each verifiers output, in plain types: token data per turn, not the
    responses themselves (the pickle the trainer unpacks stays small)."""
    keys = ("reward", "is_truncated", "metrics", "prompt_too_long", POLICY_VERSIONS_KEY, REWARD_ERRORS_KEY)
    trimmed = []
    for out in outputs:
        row = {k: out.get(k) for k in keys}
        row["trajectory"] = [{"tokens": t.get("tokens")} for t in out.get("trajectory") or []]
        err = out.get("error")
        row["error"] = err if err is None or isinstance(err, (dict, str)) else repr(err)
        row["prompt"], row["completion"] = _plain(out.get("prompt")), _plain(out.get("completion"))
        trimmed.append(row)
    return trimmed


def _plain(messages):
    if not isinstance(messages, list):
        return messages
    return [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages]


# ---------------------------------------------------------------------------------------------- trainer side


class RolloutProcess:
    """The trainer's handle on a rollout process: `generate` is awaited on the orchestrator's loop; `stages`
    mirrors the child's calls in flight, so a stuck reward function is named even while the child's loop is
    blocked by it."""

    def __init__(self, env):
        payload = copy_of(env)  # before the child starts: an environment that cannot be copied costs nothing
        ours, theirs = socket.socketpair()
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
        # it runs Python, not kernels: no thread pool of its own on the trainer's cores
        child_env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            env=child_env,
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self.stages = Stages()
        self.failed: str | None = None  # why the environment's code cannot run in the child
        self._check: asyncio.Future | None = None
        self.exited: str | None = None  # why the child is gone
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._ids = itertools.count()
        self._send_lock = threading.Lock()
        self._send(("init", list(sys.path), payload))
        self._reader = threading.Thread(target=self._read, name="vf-rl-rollout-process", daemon=True)
        self._reader.start()

    def _send(self, message) -> None:
        with self._send_lock:
            self.conn.send(message)

    def connect(self, base_url: str, model: str, api_key: str, timeout: float, seed, max_concurrent: int) -> None:
        """Talk to this server from now on (a fresh HTTP session: none of a dead server's connections)."""
        with contextlib.suppress(OSError):
            self._send(("connect", base_url, model, api_key, timeout, seed, max_concurrent))

    async def generate(self, inputs: list[dict], sampling_args: dict) -> dict:
        return {"outputs": await self._ask("generate", inputs, sampling_args)}

    async def check_once(self, first_example, env, client, model: str) -> None:
        """Before the first batch, once (reward_probe.py): ProcessUnavailable when a reward function fails in the child
        on `first_example()` but not in the trainer's process (`env`, `client`), which then generates itself."""
        if self._check is None:
            self._check = asyncio.ensure_future(self._check_child(first_example(), env, client, model))
        await asyncio.shield(self._check)  # a cancelled batch leaves the check to the others

    async def _check_child(self, row: dict, env, client, model: str) -> None:
        there = await self._ask("check", row)
        if not there:  # the usual case: nothing runs in the trainer's process
            return
        failure = only_in_child(there, await reward_failures(env, row, client, model))
        if failure is not None:
            self.failed = (
                "the environment's code fails in the rollout process but not in the trainer's, on the first training "
                f"example ({failure})"
            )
            raise ProcessUnavailable(self.failed)

    async def _ask(self, kind: str, *payload):
        if self.failed is not None:
            raise ProcessUnavailable(self.failed)
        if self.exited is not None:
            raise ProcessExited(self.exited)
        rid = next(self._ids)
        fut = self._pending[rid] = concurrent.futures.Future()
        try:
            self._send((kind, rid, *payload))
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            with contextlib.suppress(OSError):
                self._send(("cancel", rid))
            raise
        except OSError:
            raise ProcessExited(self.exited or "the rollout process is gone") from None
        finally:
            self._pending.pop(rid, None)

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "stages":
                self.stages.mirror(message[1])
            elif kind == "done":
                _resolve(self._pending.get(message[1]), result=message[2])
            elif kind == "error":
                _resolve(self._pending.get(message[1]), error=EnvironmentRaised(*message[2:]))
            elif kind == "failed":
                self.failed = f"the environment did not load in the rollout process ({message[1]})"
                self._fail_all(ProcessUnavailable(self.failed))
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(2)
        code = self.proc.poll()
        if code is not None and code < 0:
            why = f", {signal.Signals(-code).name}): it was killed (the out-of-memory killer? see dmesg)"
        else:
            why = "): see its traceback above, on stderr"
        self.exited = self.exited or f"the rollout process exited (code {code}{why}"
        self.stages.mirror([])
        # a batch sent while the child was failing to load: back to the trainer's thread, like the others
        self._fail_all(ProcessUnavailable(self.failed) if self.failed is not None else ProcessExited(self.exited))

    def _fail_all(self, error: BaseException) -> None:
        for fut in list(self._pending.values()):
            _resolve(fut, error=error)

    def close(self) -> None:
        self.exited = self.exited or "the rollout process was closed"
        with contextlib.suppress(OSError):
            self._send(("close",))
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:  # environment code that never returns: nothing else stops it
            self.proc.kill()
            self.proc.wait()
        with contextlib.suppress(OSError):
            self.conn.close()
        self._reader.join(3)


def _resolve(fut: concurrent.futures.Future | None, result=None, error: BaseException | None = None) -> None:
    if fut is None or fut.done():
        return
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)


def start_rollout_process(env) -> RolloutProcess | None:
    """A rollout process for `env`, or None (with a log line) when the environment cannot be copied into one."""
    try:
        return RolloutProcess(env)
    except Exception as e:  # noqa: BLE001 - any pickling failure: the trainer's process generates, as before
        logger.warning(
            "rollouts run in the trainer's process: the environment could not be copied into a rollout process "
            "(%s: %s)",
            type(e).__name__,
            e,
        )
        return None

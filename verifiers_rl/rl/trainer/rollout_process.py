"""Rollouts in a process of their own: the environment's code, its reward functions and the HTTP client run in a
child interpreter, so they do not take the trainer's GIL while it trains (`RLConfig.rollout_process`).

Why a process and not the orchestrator's thread: on a CPU-bound trainer the rollout code (verifiers' per-call
bookkeeping, parsing, reward functions) and the training step take turns on one GIL; measured on 2 cores, the
training step is ~30 % shorter and the async step reaches 0.90-0.94 of its bound instead of 0.68-0.76
(docs/performance.md). The trainer keeps everything that decides *what* is generated (batch indices, policy
versions, the no-sync-inside-a-batch rule, checkpoints); the child only runs `env.generate` on the inputs it is
sent and sends back the parts of each output the trainer reads.

The environment object crosses with dill (verifiers' parsers hold lambdas, and a notebook's reward functions live
in `__main__`, neither of which the standard pickle takes). A function of the user's `__main__` crosses by value,
and the globals it reads (the script's imports, helpers, constants, compiled patterns, classes) cross with it into
the child's own `__main__` (`copy_of`, `load_copy`). An environment that cannot be copied, or that fails to load
in the child, is generated in the trainer's process as before, with a log line saying why; so is one whose reward
functions fail in the child on the first training example but not in the trainer's process (`reward_failures`:
run there first, here only when it found a failure).
Protocol, over a socket pair with `multiprocessing.connection` framing (pickled tuples):

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
import dis
import inspect
import io
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import types
from multiprocessing.connection import Connection

from verifiers_rl.rl.trainer.rollouts import POLICY_VERSIONS_KEY, REWARD_ERRORS_KEY
from verifiers_rl.rl.trainer.stages import Stages

logger = logging.getLogger(__name__)

STATE_COLUMNS = ["trajectory", POLICY_VERSIONS_KEY, "prompt_too_long", REWARD_ERRORS_KEY]
_STAGES_EVERY = 0.2  # seconds between the child's reports of its calls in flight (only when they changed)


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


def copy_of(env) -> bytes:
    """`env` as dill bytes for `load_copy`. dill copies a function of the user's `__main__` (a training script, a
    notebook's cells) by value, but its globals by reference to `__main__`, which in the child is not the user's:
    the function's first use of `re` or of a helper of the script would be a NameError. So the globals such functions
    read follow the environment, and as many more as those globals' own functions read, into the child's `__main__`:
    one namespace shared by those functions, as in the trainer's process (a helper's rebinding of a global is seen by
    the others; helpers that call each other work). Functions of importable modules cross by reference, as before."""
    import dill  # datasets' own pickler: it ships with every install of ours

    main = sys.modules["__main__"]

    class MainPickler(dill.Pickler):
        """Notes the globals of `__main__` that each copied function of `__main__` reads."""

        def __init__(self, file):
            super().__init__(file)
            self._main = main  # dill's own is `__main__` as it was when dill was imported
            self.read: set[str] = set()

        def save(self, obj, save_persistent_id=True):
            if isinstance(obj, types.FunctionType) and obj.__globals__ is main.__dict__ and id(obj) not in self.memo:
                self.read |= global_names(obj.__code__) & main.__dict__.keys()
            super().save(obj, save_persistent_id)

    buffer = io.BytesIO()
    pickler = MainPickler(buffer)
    pickler.dump(env)
    shipped: set[str] = set()
    while pickler.read - shipped:  # one pickle more per round, sharing the first one's objects (the memo)
        names = sorted(pickler.read - shipped)
        shipped.update(names)
        pickler.dump({name: main.__dict__[name] for name in names})
    return buffer.getvalue()


def load_copy(payload: bytes):
    """The environment of `copy_of`, with the user's globals its functions read put into this process's
    `__main__`."""
    import dill

    stream = io.BytesIO(payload)
    unpickler = dill.Unpickler(stream)
    env = unpickler.load()
    while stream.tell() < len(payload):
        sys.modules["__main__"].__dict__.update(unpickler.load())
    return env


def global_names(code: types.CodeType) -> set[str]:
    """The global names a function's code (nested functions, comprehensions and class bodies included) reads or
    binds."""
    names = {i.argval for i in dis.get_instructions(code) if i.opname in _GLOBAL_OPS}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= global_names(const)
    return names


_GLOBAL_OPS = {"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME"}  # LOAD_NAME: a class body's


async def reward_failures(env, row: dict, client, model: str) -> list[str]:
    """Every reward function of `env` on one training example, answered with its own `answer`: how each one that
    fails does ("reward function NAME raised TYPE: message"). The same example in both processes tells code that does
    not run in the rollout process (a name its copy lacks) from code that fails wherever it runs."""
    from verifiers_rl.rl.trainer.reward_checks import _rubrics

    try:
        state = await env.init_state(row, client, model)
    except Exception as e:  # noqa: BLE001 - compared between the processes, not raised
        return [f"the environment's init_state raised {type(e).__name__}: {e}"]
    state["completion"] = _answer_of(row, state.get("answer"))
    failures = []
    for rubric in _rubrics(env.rubric):
        for func in getattr(rubric, "funcs", None) or []:
            recorded = len(state.get(REWARD_ERRORS_KEY) or [])
            try:
                await _score(rubric, func, state)
            except Exception as e:  # noqa: BLE001 - a metric's error: guarded reward functions record theirs
                name = getattr(func, "__name__", repr(func))
                failures.append(f"reward function {name} raised {type(e).__name__}: {e}")
            failures.extend((state.get(REWARD_ERRORS_KEY) or [])[recorded:])
    return failures


def _answer_of(row: dict, answer):
    """A completion that gives the example's answer, in the example's format."""
    from verifiers.utils.message_utils import normalize_messages

    text = answer if isinstance(answer, str) else ""
    if isinstance(row.get("prompt"), str):
        return text
    return normalize_messages([{"role": "assistant", "content": text}])


async def _score(rubric, func, state) -> None:
    """`func` called as verifiers' Rubric calls it (the arguments it names, or all of them), its errors raised."""
    objects = rubric.group_score_objects([state]) if rubric._is_group_func(func) else rubric.score_objects(state)
    params = inspect.signature(func).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        objects = {k: v for k, v in objects.items() if k in params}
    value = func(**objects)
    if inspect.isawaitable(value):
        await value


def only_in_child(there: list[str], here: list[str]) -> str | None:
    """The first failure of the child's that the trainer's process does not have: the same function failing with
    another exception counts (a NameError there, the example's own KeyError here)."""
    kinds = {_kind(f) for f in here}
    return next((f for f in there if _kind(f) not in kinds), None)


def _kind(failure: str) -> str:
    return failure.split(":", 1)[0]  # "reward function NAME raised TYPE"


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
            # `-c`: the child's `__main__` is a namespace of its own, which `load_copy` fills with the user's globals
            [sys.executable, "-c", f"from {__name__} import main; main()", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            env=child_env,
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self.stages = Stages()
        self.failed: str | None = None  # why the environment did not load in the child
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

    async def reward_failures(self, row: dict) -> list[str]:
        """`reward_failures` of the child's copy of the environment on `row`."""
        return await self._ask("check", row)

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
                self.failed = message[1]
                self._fail_all(ProcessUnavailable(message[1]))
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


# ---------------------------------------------------------------------------------------------- child side


class _Child:
    def __init__(self, conn: Connection):
        self.conn = conn
        self.lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self.tasks: dict[int, asyncio.Task] = {}
        self.client = None
        self.model = ""
        self.max_concurrent = 1024
        self.env = None
        self.stages = Stages()

    def send(self, message) -> None:
        with self.lock, contextlib.suppress(OSError):
            self.conn.send(message)

    def load(self, sys_path: list[str], payload: bytes) -> None:
        for entry in reversed(sys_path):  # the trainer's import path: its environment modules import here too
            if entry not in sys.path:
                sys.path.insert(0, entry)
        from verifiers_rl.rl.trainer.reward_checks import guard_rewards
        from verifiers_rl.rl.trainer.server_recovery import quiet_lost_requests
        from verifiers_rl.rl.trainer.stages import stages_of

        self.env = load_copy(payload)
        guard_rewards(self.env)  # idempotent: the copy of a guarded environment is guarded
        quiet_lost_requests(self.env)  # loggers are copied by name: filters are added again here
        self.stages = stages_of(self.env)

    def serve(self) -> None:
        try:
            _, sys_path, payload = self.conn.recv()
            self.load(sys_path, payload)
        except (EOFError, OSError):
            return
        except BaseException as e:  # noqa: BLE001 - said to the trainer, which generates itself
            self.send(("failed", f"{type(e).__name__}: {e}"))
            return
        self.send(("ready",))
        asyncio.set_event_loop(self.loop)
        self.loop.set_exception_handler(lambda loop, ctx: None)  # failures are sent, not printed twice
        threading.Thread(target=self._receive, daemon=True).start()
        threading.Thread(target=self._report_stages, daemon=True).start()
        self.loop.run_forever()

    def _receive(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                message = ("close",)
            if message[0] == "close":
                break
            self.loop.call_soon_threadsafe(self._handle, message)
        self.loop.call_soon_threadsafe(self.loop.stop)
        time.sleep(2)  # the loop did not stop: environment code that never returns holds it
        os._exit(0)

    def _handle(self, message) -> None:
        kind = message[0]
        if kind == "connect":
            self._connect(*message[1:])
        elif kind == "generate":
            rid = message[1]
            self.tasks[rid] = self.loop.create_task(self._generate(*message[1:]))
        elif kind == "check":
            rid = message[1]
            self.tasks[rid] = self.loop.create_task(self._check(*message[1:]))
        elif kind == "cancel":
            task = self.tasks.pop(message[1], None)
            if task is not None:
                task.cancel()

    def _connect(self, base_url, model, api_key, timeout, seed, max_concurrent) -> None:
        from openai import AsyncOpenAI

        from verifiers_rl.rl.trainer.rollout_client import RolloutClient

        old = self.client
        self.client = RolloutClient(
            AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout), seed, stages=self.stages
        )
        self.model, self.max_concurrent = model, max_concurrent
        if old is not None:
            self.loop.create_task(_quietly(old.close()))

    async def _generate(self, rid: int, inputs: list[dict], sampling_args: dict) -> None:
        try:
            out = await generate(self.env, inputs, self.client, self.model, sampling_args, self.max_concurrent)
            self.send(("done", rid, trim_outputs(out["outputs"])))
        except asyncio.CancelledError:
            pass
        except BaseException as e:  # noqa: BLE001 - the trainer reports it, naming the environment's frame
            self.send(("error", rid, type(e).__name__, str(e), where(e)))
        finally:
            self.tasks.pop(rid, None)

    async def _check(self, rid: int, row: dict) -> None:
        try:
            self.send(("done", rid, await reward_failures(self.env, row, self.client, self.model)))
        except asyncio.CancelledError:
            pass
        except BaseException as e:  # noqa: BLE001 - as a batch's error
            self.send(("error", rid, type(e).__name__, str(e), where(e)))
        finally:
            self.tasks.pop(rid, None)

    def _report_stages(self) -> None:
        last = None
        while True:
            time.sleep(_STAGES_EVERY)
            entries = self.stages.entries()
            if entries != last:
                self.send(("stages", entries))
                last = entries


async def _quietly(coro) -> None:
    with contextlib.suppress(Exception):
        await coro


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer says when to stop: it saves a checkpoint first
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _Child(Connection(int(sys.argv[1]))).serve()
    os._exit(0)


if __name__ == "__main__":
    main()

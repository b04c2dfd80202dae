"""The rollout process itself (`rollout_process.RolloutProcess` starts it as `python -c`): it loads the environment
the trainer copied in, runs `env.generate` on the batches it is sent, and mirrors its calls in flight back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

from verifiers_rl.rollouts.main_copies import load_copy
from verifiers_rl.rollouts.process import generate, trim_outputs, where
from verifiers_rl.rollouts.reward_probe import reward_failures
from verifiers_rl.rollouts.stages import Stages

_STAGES_EVERY = 0.2  # seconds between the child's reports of its calls in flight (only when they changed)


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
        from verifiers_rl.rollouts.reward_checks import guard_rewards
        from verifiers_rl.rollouts.stages import stages_of
        from verifiers_rl.serving.recovery import quiet_lost_requests

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

        from verifiers_rl.rollouts.client import RolloutClient

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

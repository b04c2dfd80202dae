"""A dead inference server is replaced, and the step goes on.

When the server's process dies (the OOM killer, a CUDA fault, kill -9), every request to it fails and every
weight sync too. The runtime asks here: the server is started again (ours: same port and token, after a backoff;
one we only connected to: awaited for `server_restart_grace` seconds), the current weights are synced into it
(it starts from the model files), the batches that were generating against the dead one are dropped and generated
again (a batch is a pure function of its index), and the step continues: one log line per restart, one metrics
row per step. `server_restarts` bounds the restarts in a row (a batch that comes back clean resets the count);
past it, or when a connected server does not come back, the run stops with `ServerLost`, whose message says how
to resume.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import time

from verifiers_rl.errors import ServerError, ServerLost

logger = logging.getLogger(__name__)

SETTLE_S = 3.0  # how long a process whose connections just broke may take to be gone
# how a request reads when the server died before or while answering it (aiohttp's ClientPayloadError: the
# response's body was cut off by the kill)
_UNREACHABLE = (
    "APIConnectionError",
    "Connection reset",
    "Connection refused",
    "ServerDisconnected",
    "ClientPayloadError",
)
RUN_COMMAND_ENV = "VF_RUN_COMMAND"  # the command a user ran (vf-rl sets it for the trainer processes it starts)


class ServerRecovery:
    def __init__(self, runtime):
        self.runtime = runtime
        self.in_a_row = 0  # restarts since the last batch that came back from a serving server
        self.total = 0

    def lost(self, batch=None) -> str | None:
        """Why the server is gone (None: it serves). With a batch: asked only when a rollout errored, and given a
        moment to die only when one failed to reach the server; without one (a request to it failed): always."""
        if batch is None:
            return self.runtime.session.down(settle=SETTLE_S)
        errors = [r.error or "" for r in batch.rollouts if r.error_kind == "errored"]
        if not errors:
            return None
        unreachable = any(marker in e for e in errors for marker in _UNREACHABLE)
        return self.runtime.session.down(settle=SETTLE_S if unreachable else 0.0)

    def served(self) -> None:
        """A batch came back from a serving server: the next failure counts from zero again."""
        self.in_a_row = 0

    def replace(self, cause: str) -> None:
        """Start a server where the lost one was, sync the current weights into it, regenerate lost batches."""
        rt, args = self.runtime, self.runtime.args
        session = rt.session
        export, version = rt.current()  # a sharded export: its sync's walk opens to the other ranks
        limit = args.server_restarts  # a server we only connected to: how often it is awaited in a row
        if self.in_a_row >= limit:
            bound = f"server_restarts={args.server_restarts}"
            if self.in_a_row:
                raise self._give_up(f"{cause}, again after {self.in_a_row} replacement(s) in a row ({bound})")
            raise self._give_up(f"{cause} (restarts are off: {bound})")
        self.in_a_row += 1
        self.total += 1
        if session.restartable:
            delay = min(2.0 ** (self.in_a_row - 1), 30.0)  # a crash loop must not spin
            logger.warning(
                "%s; restarting it (%d of %d in a row) in %.0fs: the current weights are synced into it and the "
                "lost rollouts generated again",
                cause,
                self.in_a_row,
                limit,
                delay,
            )
            time.sleep(delay)
        else:
            logger.warning(
                "%s; waiting up to server_restart_grace=%.0fs for it to come back", cause, args.server_restart_grace
            )
        if rt.orchestrator is not None:
            rt.orchestrator.discard_unfinished()
        rt.policy.detach()
        try:
            client = session.replace(args.server_restart_grace)
        except ServerError as e:
            if session.restartable:
                raise self._give_up(f"{cause}; starting it again failed: {e}") from None
            grace = args.server_restart_grace
            raise self._give_up(f"{cause}; it did not come back within server_restart_grace={grace:.0f}s") from None
        rt.policy.attach(client, session.plan.weights, session.started_from)
        if rt.orchestrator is not None:
            rt.orchestrator.reconnect(client.base_url + "/v1", session.model_name)
        rt.policy.sync(export, version)

    def _give_up(self, what: str) -> ServerLost:
        session = self.runtime.session
        where, tail = session.location()
        start = "" if session.restartable else "start it again, "  # ours starts with the command that resumes
        return ServerLost(f"{what}; {where}; {start}{resume_hint()}{tail}")


def resume_hint() -> str:
    """How to resume, for the message of a run that stops: the command that was run, again."""
    command = os.environ.get(RUN_COMMAND_ENV)
    if not command and os.path.basename(sys.argv[0]).startswith("vf-"):
        command = shlex.join([os.path.basename(sys.argv[0]), *sys.argv[1:]])
    if command:
        return f"then run `{command}` again: it resumes from the last checkpoint"
    return "then resume with trainer.train(resume_from_checkpoint=True)"


class _LostRequests(logging.Filter):
    """verifiers logs every rollout whose model request failed; when the server died, that is one line per
    rollout for one event the trainer reports itself (a restart, or the error that ends the run)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not (text.startswith("Aborted rollout due to ModelError()") and any(m in text for m in _UNREACHABLE))


def quiet_lost_requests(env) -> None:
    for target in (env, *(getattr(env, "envs", None) or [])):
        logger_ = getattr(target, "logger", None)
        if isinstance(logger_, logging.Logger) and not any(isinstance(f, _LostRequests) for f in logger_.filters):
            logger_.addFilter(_LostRequests())

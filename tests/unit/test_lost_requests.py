"""When the server dies, verifiers logs one "Aborted rollout" line per request in flight; the trainer reports the
event once itself, so those lines are filtered, and only those (the messages are the ones verifiers 0.1.14 and
aiohttp print, copied from runs where the server was killed)."""

import logging

import pytest

from verifiers_rl.serving.recovery import quiet_lost_requests

LOST = [
    "Aborted rollout due to ModelError() -> APIConnectionError('Connection error.')",
    "Aborted rollout due to ModelError() -> ClientOSError(104, 'Connection reset by peer')",
    "Aborted rollout due to ModelError() -> ServerDisconnected('Server disconnected')",
    "Aborted rollout due to ModelError() -> ClientConnectorError('Cannot connect to host 127.0.0.1:8000 "
    "[Connection refused]')",
    # killed while the response body was on its way (CI, 2026-11-28)
    'Aborted rollout due to ModelError() -> ClientPayloadError("Response payload is not completed: '
    "<ContentLengthError: 400, message='Not enough data to satisfy content length header (received 0 of 1585 "
    "bytes).'>\") -> <ContentLengthError: 400, message='Not enough data to satisfy content length header "
    "(received 0 of 1585 bytes).'>",
]
KEPT = [
    "Aborted rollout due to ModelError() -> BadRequestError('max_tokens is too large')",
    "Aborted rollout due to ToolError() -> RuntimeError('Connection refused by the tool server')",
    "reward function failed: ClientPayloadError",
]


class _Env:
    def __init__(self):
        self.logger = logging.getLogger(f"test_lost_requests.{id(self)}")


@pytest.mark.parametrize("message", LOST + KEPT)
def test_only_requests_lost_with_the_server_are_quiet(message, caplog):
    env = _Env()
    quiet_lost_requests(env)
    quiet_lost_requests(env)  # once per logger, however often it is asked
    assert len(env.logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger=env.logger.name):
        env.logger.warning(message)
    assert bool(caplog.records) == (message in KEPT)

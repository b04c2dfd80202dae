"""A failed sync reports the server's reason, not what happened to the connection afterwards.

vLLM answers a worker's error with a 500 and then closes the keep-alive connection: the client's next request
(the /resume that ends every sync) found a dead connection and its "connection reset" replaced the reason. A
small HTTP server here does what vLLM's does, deterministically: it answers /update_weights with a 500 and drops
the connection at the next request on it.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from verifiers_rl.serving.client import InferenceClient, ServerError


class ClosesAfterAnError(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn
    calls: list[str] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if getattr(self, "failed", False):  # the connection the server gave up on
            self.close_connection = True
            return
        ClosesAfterAnError.calls.append(self.path)
        status, body = (
            (500, {"error": "weight update failed: no such module"}) if self.path == "/update_weights" else (200, {})
        )
        self.failed = status == 500
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), ClosesAfterAnError)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    ClosesAfterAnError.calls = []
    yield srv.server_address[1]
    srv.shutdown()


def test_the_reason_survives_a_connection_the_server_dropped(server):
    client = InferenceClient(port=server)
    try:
        with pytest.raises(ServerError, match="no such module"), client.paused():
            client.post("/update_weights", {"update_info": {}})
        assert ClosesAfterAnError.calls == [
            "/pause?mode=keep",
            "/update_weights",
            "/resume",
        ]  # resumed, on a new connection
    finally:
        client.close()

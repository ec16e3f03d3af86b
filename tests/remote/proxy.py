"""A tiny HTTP proxy between one remote worker and the control plane.

It forwards every request, records each exchange (what the worker asked and
what the control plane answered — never the headers, which carry the worker
token), and can misbehave on purpose:

* `drop_reply_once(pattern)`: forward the first matching request, then close
  the worker's connection instead of relaying the answer (a lost response);
* `hold(pattern)`: keep matching requests until `release()` (a slow network).

The upstream being down is relayed as a closed connection, as a worker
talking to a dead control plane would see it.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "content-length"}


@dataclasses.dataclass
class Exchange:
    at: float  # time.time() when the request arrived
    method: str
    path: str
    request: bytes
    status: int | None = None  # None: the upstream could not be reached
    response: bytes = b""
    headers: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    dropped: bool = False  # the answer was not relayed to the worker

    def json(self) -> dict:
        return json.loads(self.request or b"{}")

    def answer(self) -> dict:
        return json.loads(self.response or b"{}")


class Proxy:
    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.exchanges: list[Exchange] = []
        self.lock = threading.Lock()
        self._drop: re.Pattern | None = None
        self._hold: re.Pattern | None = None
        self.released = threading.Event()
        self.held = threading.Event()  # set once a request is being held
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="proxy", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def drop_reply_once(self, pattern: str) -> None:
        self._drop = re.compile(pattern)

    def hold(self, pattern: str) -> None:
        self.released.clear()
        self.held.clear()
        self._hold = re.compile(pattern)

    def release(self) -> None:
        self._hold = None
        self.released.set()

    def matching(self, pattern: str) -> list[Exchange]:
        with self.lock:
            return [e for e in self.exchanges if re.search(pattern, f"{e.method} {e.path}")]

    def close(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()

    # called from the handler threads

    def _forward(self, method: str, path: str, headers: dict, body: bytes) -> Exchange:
        line = f"{method} {path}"
        exchange = Exchange(at=time.time(), method=method, path=path, request=body)
        if self._hold is not None and self._hold.search(line):
            self.held.set()
            self.released.wait(60)
        try:
            upstream = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=60)
            upstream.request(method, path, body=body or None, headers=headers)
            reply = upstream.getresponse()
            exchange.status, exchange.response = reply.status, reply.read()
            exchange.headers = [(k, v) for k, v in reply.getheaders() if k.lower() not in HOP_BY_HOP]
            upstream.close()
        except OSError:
            exchange.dropped = True
        with self.lock:
            if not exchange.dropped and self._drop is not None and self._drop.search(line):
                self._drop = None
                exchange.dropped = True
            self.exchanges.append(exchange)
        return exchange


def _handler(proxy: Proxy):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _relay(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
            exchange = proxy._forward(self.command, self.path, headers, body)
            if exchange.dropped:
                self.close_connection = True  # no answer at all: the worker sees the connection drop
                return
            try:
                self.send_response(exchange.status)
                for name, value in exchange.headers:
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(exchange.response)))
                self.end_headers()
                self.wfile.write(exchange.response)
            except OSError:  # the worker went away (killed by the test) while we waited upstream
                self.close_connection = True

        do_GET = do_POST = _relay

        def log_message(self, format, *args):  # noqa: A002 - BaseHTTPRequestHandler's signature
            pass

    return Handler

"""What the fake vendor APIs share: a JSON HTTP server on 127.0.0.1 in a thread, bearer auth,
a request log, injected failures, and the loopback sshd that stands in for an instance.

An "instance" is the test sshd: the fake answers with its address and port, and installs the
instance's SSH key in the sshd's authorized_keys while the instance exists (removing it again
when the instance is deleted), so a deleted instance really stops letting gpuctl in.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit


@dataclass
class SshTarget:
    """Where the fake's instances answer SSH (the test sshd)."""

    address: str
    port: int
    authorized_keys: Path
    user: str = "root"

    def add_key(self, line: str) -> None:
        lines = self.authorized_keys.read_text().splitlines() if self.authorized_keys.exists() else []
        if line.strip() not in lines:
            self.authorized_keys.write_text("\n".join([*lines, line.strip()]) + "\n")

    def remove_key(self, line: str) -> None:
        lines = self.authorized_keys.read_text().splitlines()
        self.authorized_keys.write_text("".join(f"{x}\n" for x in lines if x.strip() != line.strip()))


@dataclass
class Call:
    """One request as the server saw it: what the oracle tests compare."""

    method: str
    path: str
    query: dict[str, str]
    body: object
    headers: dict[str, str]


class ApiError(Exception):
    def __init__(self, status: int, body: dict):
        super().__init__(status)
        self.status, self.body = status, body


@dataclass
class FakeApi:
    """Subclasses implement handle(method, path, body, query) -> (status, json body)."""

    key: str = "fake-key-0123456789abcdef"
    ssh: SshTarget | None = None
    requests: list[tuple[str, str]] = field(default_factory=list)
    fail_next: list[int] = field(default_factory=list)  # answer the next requests with these statuses
    raw_paths: list[str] = field(default_factory=list)  # as sent, query string included
    calls: list[Call] = field(default_factory=list)  # every authorized request, body parsed
    # Called in the serving thread as each request arrives, before it is answered, with its method
    # and path: it may signal the client (a Ctrl-C at that request) or block (a slow vendor).
    on_request: Callable[[str, str], None] | None = None
    # Called in the serving thread once the fake has acted on an authorized request and before
    # its answer goes out, with the method, path and parsed body: it may kill the client then (a
    # create the vendor did whose answer gpuctl never read) or hold the answer.
    on_answer: Callable[[str, str, object], None] | None = None

    # Rewrites each answer (method, path, request body, answer) -> what is sent instead: a vendor
    # that answers in another shape (tests/test_hardening_vendor_answers.py). The fake's own state
    # changed as for the true answer (an instance it reports badly is still created).
    mangle: Callable[[str, str, object, object], object] | None = None

    def __post_init__(self):
        self.crashes: list[str] = []  # handler exceptions (a bug in the fake or in a test's patch)
        self.lock = threading.RLock()
        self.server: ThreadingHTTPServer | None = None

    # lifecycle ---------------------------------------------------------------------------------
    def start(self) -> FakeApi:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self):
                fake._dispatch(self)

            do_GET = do_POST = do_PUT = do_DELETE = _serve

            def log_message(self, *args):  # quiet
                pass

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address):  # quiet when the client went away
                if not isinstance(sys.exc_info()[1], ConnectionError):  # (a Ctrl-C test held its request)
                    fake.crashes.append(repr(sys.exc_info()[1]))
                    super().handle_error(request, client_address)

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server:
            self.server.shutdown()
            self.server.server_close()
        # A fake that crashed answered nothing: the client retried for its whole backoff and the
        # test passed slowly on a path it did not mean to test.
        assert not self.crashes, f"the fake {type(self).__name__} crashed serving a request: {self.crashes}"

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    # requests ----------------------------------------------------------------------------------
    def _dispatch(self, req: BaseHTTPRequestHandler) -> None:
        split = urlsplit(req.path)
        query = {k: v[0] for k, v in parse_qs(split.query).items()}
        length = int(req.headers.get("Content-Length") or 0)
        raw = req.rfile.read(length) if length else b""
        with self.lock:
            self.requests.append((req.command, split.path))
            self.raw_paths.append(req.path)
        if self.on_request is not None:
            self.on_request(req.command, split.path)
        with self.lock:
            if self.fail_next:
                status = self.fail_next.pop(0)
                return self._reply(
                    req, status, {"error": "injected", "msg": f"injected HTTP {status}"}, {"Retry-After": "0"}
                )
            token = (req.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
            if token != self.key and query.get("api_key") != self.key:
                return self._reply(req, 401, self.unauthorized())
            try:
                body = json.loads(raw) if raw.strip() else None
            except json.JSONDecodeError:
                return self._reply(req, 400, {"error": "bad_json", "msg": "request body is not JSON"})
            headers = {k.lower(): v for k, v in req.headers.items() if k.lower() != "authorization"}
            self.calls.append(Call(req.command, split.path, query, body, headers))
            try:
                status, answer = self.handle(req.command, split.path, body, query)
            except ApiError as err:
                status, answer = err.status, err.body
            if self.mangle is not None:
                answer = self.mangle(req.command, split.path, body, answer)
        if self.on_answer is not None:
            self.on_answer(req.command, split.path, body)
        self._reply(req, status, answer)

    def _reply(self, req: BaseHTTPRequestHandler, status: int, body: object, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        req.send_response(status)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            req.send_header(k, v)
        req.end_headers()
        req.wfile.write(data)

    def unauthorized(self) -> dict:
        return {"success": False, "error": "auth_error", "msg": "Invalid user key"}

    def handle(self, method: str, path: str, body, query: dict) -> tuple[int, dict]:
        raise NotImplementedError

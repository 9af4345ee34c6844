"""The vendor API key never follows a redirect to another origin (issue 34, item 9): urllib's default
redirect handler re-sends every header, `Authorization: Bearer <key>` included, to wherever a 30x
points. Two loopback servers: the API on 127.0.0.1 redirects, the other origin on 127.0.0.2
records what reaches it. Both the laptop's client (providers/http.py) and the node-side teardown
script (providers/teardown.py, run by the guard and after a run) are checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from provision.core.errors import ProviderError
from provision.providers.http import JsonApi, RetryPolicy
from provision.providers.teardown import http_teardown

pytestmark = pytest.mark.timeout(120)
KEY = "secret-api-key-0123456789"
FAST = RetryPolicy(attempts=3, first_wait_s=0.01, max_wait_s=0.05, timeout_s=5)


@dataclass
class Server:
    """A loopback HTTP server: /same/* redirects to /ok on itself, /ok answers (and whether the
    key came), anything else is redirected with `status` to `elsewhere` (when set) or answered."""

    address: str
    status: int = 302
    elsewhere: str = ""
    seen: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                server.seen.append((self.command, self.path, dict(self.headers)))
                if self.path.startswith("/same/"):
                    return self._send(302, b"", {"Location": "/ok"})
                if server.elsewhere and self.path != "/ok":
                    return self._send(server.status, b"", {"Location": server.elsewhere + self.path})
                keyed = self.headers.get("Authorization") == f"Bearer {KEY}"
                body = {"fine": True, "keyed": keyed, "instances": {"id": 7000001}}
                return self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})

            def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
                self.send_response(status)
                for k, v in {**headers, "Content-Length": str(len(body))}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_DELETE = _serve

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer((self.address, 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def origin(self) -> str:
        return f"http://{self.address}:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers() -> Iterator[tuple[Server, Server]]:
    other = Server("127.0.0.2")
    api = Server("127.0.0.1", elsewhere=other.origin)
    try:
        yield api, other
    finally:
        api.close()
        other.close()


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
@pytest.mark.parametrize("method", ["GET", "POST"])
def test_the_laptop_client_never_sends_the_key_to_another_origin(servers, status, method):
    api, other = servers
    api.status = status
    with pytest.raises(ProviderError) as err:
        JsonApi("Acme", api.origin, KEY, "$ACME_KEY", FAST).request(method, "/api/v0/things/", {"a": 1})
    line = err.value.one_line()
    assert f"Acme API redirected {method} /api/v0/things/ to another origin ({other.origin})" in line
    assert "the API key is not sent there" in line and "provider.api_url" in line and KEY not in line
    assert other.seen == []  # never contacted, so never given the key
    assert len(api.seen) == 1  # not retried: a redirect is no transient failure


def test_a_redirect_within_the_api_origin_is_followed(servers):
    api, other = servers
    answer = JsonApi("Acme", api.origin, KEY, "$ACME_KEY", FAST).request("GET", "/same/x")
    assert answer["fine"] and answer["keyed"]  # same origin: the key goes along
    assert [p for _m, p, _h in api.seen] == ["/same/x", "/ok"] and other.seen == []


def node_script(argv: list[str], key: str = KEY) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPUCTL_TEARDOWN_KEY": key}
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("status", [302, 307])
def test_the_node_side_teardown_never_sends_the_key_to_another_origin(servers, status):
    api, other = servers
    api.status = status
    runpod_like = http_teardown(
        sys.executable,
        "POST",
        [(f"{api.origin}/graphql", json.dumps({"query": "mutation"}))],
        KEY,
        check_method="GET",
        checks=[(f"{api.origin}/api/v0/instances/7000001/", "", "7000001")],
    )
    assert KEY not in " ".join(runpod_like.argv) and runpod_like.check is not None
    started = time.monotonic()
    for argv, who in ((runpod_like.argv, "self-teardown"), (runpod_like.check, "teardown check")):
        done = node_script(argv)
        assert done.returncode == 1, done.stdout + done.stderr
        said = f"gpuctl: {who} refused: the API redirected to another origin ({other.origin})"
        assert said in done.stdout, done.stdout
        assert KEY not in done.stdout + done.stderr
    assert time.monotonic() - started < 30  # refused at once, not retried for ten minutes
    assert other.seen == []


def test_the_node_side_check_passes_on_the_api_itself(servers):
    api, other = servers
    api.elsewhere = ""  # no redirect: the API answers with the instance
    teardown = http_teardown(
        sys.executable, "DELETE", [], KEY, check_method="GET", checks=[(f"{api.origin}/i/7000001/", "", "7000001")]
    )
    assert teardown.check is not None
    done = node_script(teardown.check)
    assert done.returncode == 0 and "teardown check passed" in done.stdout, done.stdout
    missing = http_teardown(
        sys.executable, "DELETE", [], KEY, check_method="GET", checks=[(f"{api.origin}/i/42/", "", "42")]
    )
    assert missing.check is not None
    refused = node_script(missing.check)
    assert refused.returncode == 1 and "does not show instance 42" in refused.stdout
    assert other.seen == []

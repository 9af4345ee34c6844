"""providers/http.py: bounded retries with backoff, auth and error lines without the key."""

from __future__ import annotations

import time

import pytest

from provision.core.errors import AuthError, ProviderError
from provision.providers import http
from provision.providers.http import ApiNotFound, JsonApi, RetryPolicy, load_key
from tests.fakes.base import ApiError, FakeApi

pytestmark = pytest.mark.timeout(60)
FAST = RetryPolicy(attempts=4, first_wait_s=0.01, max_wait_s=0.05, timeout_s=5)


class Echo(FakeApi):
    """Answers GET /ok, 404s /gone, and echoes the caller's auth header in a 400 on /echo."""

    def handle(self, method, path, body, query):
        if path == "/ok":
            return 200, {"fine": True}
        if path == "/echo":
            raise ApiError(400, {"msg": f"bad request from {self.key}"})
        raise ApiError(404, {"msg": "no such thing"})


@pytest.fixture
def server():
    with Echo() as fake:
        yield fake


def client(fake: FakeApi, key: str | None = None, retry: RetryPolicy = FAST) -> JsonApi:
    return JsonApi("Acme", fake.origin, key or fake.key, "$ACME_KEY", retry)


def test_retries_429_and_5xx_with_backoff_then_succeeds(server):
    server.fail_next = [429, 503, 500]
    assert client(server).request("GET", "/ok") == {"fine": True}
    assert len(server.requests) == 4


def test_gives_up_after_the_bounded_tries_with_one_clear_line(server):
    server.fail_next = [503] * 10
    started = time.monotonic()
    with pytest.raises(ProviderError) as err:
        client(server).request("GET", "/ok")
    assert len(server.requests) == FAST.attempts
    assert time.monotonic() - started < 5
    line = err.value.one_line()
    assert "Acme API kept failing on GET /ok: HTTP 503" in line and "4 tries" in line and "\n" not in line


def test_401_is_a_clear_line_without_the_key(server):
    wrong = "wrong-key-SECRET-123456"
    with pytest.raises(AuthError) as err:
        client(server, key=wrong).request("GET", "/ok")
    assert "rejected the API key from $ACME_KEY (HTTP 401)" in err.value.one_line()
    assert wrong not in err.value.one_line()
    assert len(server.requests) == 1  # not retried


def test_a_server_echoing_the_key_is_redacted(server):
    with pytest.raises(ProviderError) as err:
        client(server).request("GET", "/echo")
    assert server.key not in err.value.one_line() and "***" in err.value.one_line()


def test_404_is_not_found(server):
    with pytest.raises(ApiNotFound):
        client(server).request("DELETE", "/thing/1/")


def test_unreachable_server_is_retried_then_one_line():
    with pytest.raises(ProviderError) as err:
        JsonApi("Acme", "http://127.0.0.1:9", "k" * 20, "$ACME_KEY", FAST).request("GET", "/ok")
    assert "cannot reach http://127.0.0.1:9" in err.value.one_line()


def test_retry_after_is_honoured_but_capped(server, monkeypatch):
    waits = []
    api = client(server, retry=RetryPolicy(attempts=2, first_wait_s=0.01, max_wait_s=0.2, timeout_s=5))
    real = api._wait
    monkeypatch.setattr(api, "_wait", lambda state: waits.append(real(state)) or waits[-1])
    server.fail_next = [429]
    api.request("GET", "/ok")
    assert 0 < waits[0] <= 0.2


def test_load_key_env_then_files(tmp_path, monkeypatch):
    monkeypatch.delenv("ACME_KEY", raising=False)
    keyfile = tmp_path / "key"
    with pytest.raises(AuthError) as err:
        load_key("Acme", "ACME_KEY", [keyfile])
    assert "no Acme API key found" in err.value.one_line() and str(keyfile) in err.value.one_line()
    keyfile.write_text("  from-file \n")
    assert load_key("Acme", "ACME_KEY", [keyfile]) == ("from-file", str(keyfile))
    monkeypatch.setenv("ACME_KEY", "from-env")
    assert load_key("Acme", "ACME_KEY", [keyfile]) == ("from-env", "$ACME_KEY")


def test_default_policy_is_bounded():
    policy = http.DEFAULT_RETRY
    assert 2 <= policy.attempts <= 10 and policy.max_wait_s <= 60


def test_a_create_is_retried_on_429_only(server):
    server.fail_next = [429, 429]
    assert client(server).request("GET", "/ok", idempotent=False) == {"fine": True}
    server.requests.clear()
    server.fail_next = [503, 503]
    with pytest.raises(ProviderError) as err:
        client(server).request("GET", "/ok", idempotent=False)
    assert len(server.requests) == 1 and "(1 try)" in err.value.one_line()

"""The one JSON-over-HTTP client the vendor APIs share (stdlib urllib, no requests).

- auth travels in a header (`Authorization: Bearer KEY`), never in a URL, argv or message;
- 429, 5xx and connection failures are retried with jittered exponential backoff (tenacity),
  a bounded number of times, honouring Retry-After; then one clear ProviderError;
- 401/403 become AuthError naming where the key came from, never the key itself;
- 404 becomes ApiNotFound so terminate() can treat "already gone" as success; another 4xx is
  ApiRefused with the body's reason (msg/error/detail, or a GraphQL reply's errors[] messages);
- a redirect is followed only within the API's origin (scheme, host, port): urllib's default
  handler re-sends every header, the key's included, to wherever a 30x points; off the origin
  it is one error line and the other host is never contacted.
Every message passes through `redact`, so even a server that echoes the key back cannot leak it.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
    wait_random,
)

from provision.core import interrupt
from provision.core.errors import AuthError, ConfigError, ProviderError

USER_AGENT = "gpuctl/0.1"


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 6  # tries in all, the first included
    first_wait_s: float = 1.0
    max_wait_s: float = 20.0  # one wait never exceeds this (Retry-After included)
    timeout_s: float = 30.0  # per request


DEFAULT_RETRY = RetryPolicy()


class ApiNotFound(ProviderError):
    """HTTP 404: the thing asked about does not exist (any more)."""


class ApiRefused(ProviderError):
    """Another 4xx: the server understood and said no; `detail` is what its body says why."""

    def __init__(self, message: str, status: int, detail: str):
        super().__init__(message)
        self.status = status
        self.detail = detail


class _OffOrigin(Exception):
    """A 30x pointing away from the API's origin: the request with the key is not sent there."""

    def __init__(self, target: str):
        super().__init__(target)
        self.target = target


def origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) with the scheme's default port filled in: what a redirect may not leave."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port or {"http": 80, "https": 443}.get(scheme)
    except ValueError:  # a port that is not a number: no origin matches it
        port = -1
    return scheme, (parts.hostname or "").lower(), port


class _SameOriginRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: Any,
        code: int,
        msg: str,
        headers: Any,
        newurl: str,
    ) -> urllib.request.Request | None:
        if origin(newurl) != origin(req.full_url):
            fp.close()
            raise _OffOrigin(newurl)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_OPENER = urllib.request.build_opener(_SameOriginRedirects)  # replaces the default redirect handler


class _Transient(Exception):
    def __init__(self, detail: str, retry_after: float | None = None):
        super().__init__(detail)
        self.detail = detail
        self.retry_after = retry_after


class _RateLimited(_Transient):
    """HTTP 429: the server did nothing; always safe to retry."""


def redact(text: str, *secrets: str | None) -> str:
    for secret in secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    return text


def load_key(
    vendor: str, env_var: str, files: list[Path], parse: Callable[[str], str] = lambda text: text.strip()
) -> tuple[str, str]:
    """The API key and where it came from (for messages). Raises AuthError when there is none."""
    if os.environ.get(env_var, "").strip():
        return os.environ[env_var].strip(), f"${env_var}"
    for path in files:
        path = path.expanduser()
        if path.is_file():
            key = parse(path.read_text())
            if key:
                return key, str(path)
    where = " or ".join([f"${env_var}", *(str(p) for p in files)])
    raise AuthError(f"no {vendor} API key found (looked in {where})", f"export {env_var}=... (your {vendor} API key)")


class JsonApi:
    """A vendor's JSON API at base_url. `key_source` names where the key came from, for messages."""

    def __init__(self, vendor: str, base_url: str, key: str, key_source: str, retry: RetryPolicy | None = None):
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"provider.api_url {base_url!r} is not an http(s) URL", "give the full URL")
        self.vendor = vendor
        self.base_url = base_url.rstrip("/")
        self._key = key
        self._hidden: list[str] = []  # other secrets a request carries (a registry password): never in a message
        self.key_source = key_source
        self.retry = retry or DEFAULT_RETRY

    def secret(self) -> str:
        """The key itself, for the node's self-teardown env (secrets.env); never print it."""
        return self._key

    def hide(self, secret: str) -> None:
        """A secret this client's requests carry besides the key: errors and answers quoted in
        messages have it replaced (a server may echo what it was sent)."""
        self._hidden.append(secret)

    def redact(self, text: str) -> str:
        return redact(text, self._key, *self._hidden)

    def request(self, method: str, path: str, body: Any = None, *, idempotent: bool = True) -> Any:
        """idempotent=False (a create): only a 429 is retried. After a 5xx or a lost connection
        the server may have acted, and a retry could create a second, untracked instance."""
        policy = self.retry
        retryable = _Transient if idempotent else _RateLimited
        retrying = Retrying(
            stop=stop_after_attempt(policy.attempts),
            wait=self._wait,
            retry=retry_if_exception_type(retryable),
            reraise=True,
        )
        try:
            for attempt in retrying:
                interrupt.check()  # a Ctrl-C swallowed since the last call stops here, before the vendor acts
                with attempt:
                    return self._once(method, path, body)
        except _Transient as exc:
            tries = retrying.statistics.get("attempt_number", 1)
            raise ProviderError(
                f"{self.vendor} API kept failing on {method} {path or '/'}: {self.redact(exc.detail)} "
                f"({tries} {'try' if tries == 1 else 'tries'})",
                f"wait a few minutes and retry; the {self.vendor} API is rate-limiting or down",
            ) from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _wait(self, state: RetryCallState) -> float:
        first = self.retry.first_wait_s
        backoff = (wait_exponential(multiplier=first, max=self.retry.max_wait_s) + wait_random(0, first))(state)
        exc = state.outcome.exception() if state.outcome else None
        hinted = getattr(exc, "retry_after", None)
        return min(self.retry.max_wait_s, max(backoff, hinted or 0.0))

    def _once(self, method: str, path: str, body: Any) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.base_url + path,
            data=data,
            method=method,
            headers={
                "Authorization": f"Bearer {self._key}",
                "Accept": "application/json",
                "Content-Type": "application/json",
                "User-Agent": USER_AGENT,
            },
        )
        try:
            with _OPENER.open(req, timeout=self.retry.timeout_s) as resp:
                raw = resp.read()
        except _OffOrigin as off:
            there = origin(off.target)
            raise ProviderError(
                f"{self.vendor} API redirected {method} {path or '/'} to another origin "
                f"({self.redact(f'{there[0]}://{there[1]}:{there[2]}')}); the API key is not sent there",
                "set provider.api_url to the API's own address",
            ) from None
        except urllib.error.HTTPError as err:
            self._raise_for(err, method, path)
        except (urllib.error.URLError, OSError) as err:  # refused, reset, DNS, timeout
            reason = getattr(err, "reason", err)
            raise _Transient(f"cannot reach {self.base_url} ({reason})") from None
        try:
            return json.loads(raw) if raw.strip() else None
        except json.JSONDecodeError:
            raise ProviderError(
                f"{self.vendor} API answered {method} {path} with non-JSON", "check provider.api_url"
            ) from None

    def _raise_for(self, err: urllib.error.HTTPError, method: str, path: str) -> None:
        code = err.code
        detail = self.redact(_error_text(err))
        if code in (401, 403):
            raise AuthError(
                f"{self.vendor} rejected the API key from {self.key_source} (HTTP {code})",
                f"check the key in {self.key_source} (a valid key with read/write access)",
            )
        if code == 429:
            raise _RateLimited(f"HTTP 429{': ' + detail if detail else ''}", _retry_after(err))
        if code >= 500:
            raise _Transient(f"HTTP {code}{': ' + detail if detail else ''}", _retry_after(err))
        if code == 404:
            raise ApiNotFound(f"{self.vendor}: {method} {path}: not found{': ' + detail if detail else ''}")
        raise ApiRefused(
            f"{self.vendor} API refused {method} {path or '/'} (HTTP {code}){': ' + detail if detail else ''}",
            code,
            detail,
        )


def _error_text(err: urllib.error.HTTPError) -> str:
    try:
        raw = err.read()[:2000].decode(errors="replace")
    except OSError:
        return ""
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError:
        return " ".join(raw.split())[:200]
    if isinstance(doc, dict):
        parts = [str(doc[k]) for k in ("msg", "error", "detail", "message") if doc.get(k)]
        errors = doc.get("errors")  # GraphQL: {"errors": [{"message": ...}, ...]}
        if isinstance(errors, list):
            parts += [str(e.get("message", e)) if isinstance(e, dict) else str(e) for e in errors]
        return "; ".join(parts)[:300]
    return ""


def _retry_after(err: urllib.error.HTTPError) -> float | None:
    value = err.headers.get("Retry-After") if err.headers else None
    try:
        return float(value) if value else None
    except ValueError:
        return None

"""gpuctl's own known_hosts: host keys pinned on first contact, then enforced.

``known_hosts_path() -> Path``: gpuctl's known_hosts (OpenSSH format, under the state dir).
``host_key_name(address, port)``: how a host is named there. ``load_known_hosts()``: its keys.
``PinPolicy(pin_new)``: the paramiko policy for an unknown key: pinned when ``pin_new`` (only
`gpuctl up`, on first contact, which prints the key's SHA256 fingerprint and refuses a key that
differs from the user's ~/.ssh/known_hosts entry for the host), else refused with UnknownHostKey. A changed key is always
refused (paramiko raises BadHostKeyException). ``unpin(host, port) -> int`` drops a host's
pinned keys (every port when port is None) and returns how many lines went.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

import paramiko

from provision.core import state
from trainer.objstore.atomic import atomic_write


class UnknownHostKey(paramiko.SSHException):  # type: ignore[misc]  # paramiko ships no type information
    def __init__(self, hostname: str, key: paramiko.PKey):
        super().__init__(f"unknown host key for {hostname}")
        self.hostname = hostname
        self.key = key


def known_hosts_path() -> Path:
    return state.state_dir() / "known_hosts"


def host_key_name(address: str, port: int) -> str:
    """How OpenSSH and paramiko name a host in known_hosts."""
    return address if port == 22 else f"[{address}]:{port}"


def load_known_hosts() -> paramiko.HostKeys:
    keys = paramiko.HostKeys()
    path = known_hosts_path()
    if path.is_file():
        keys.load(str(path))
    return keys


def pin_host_key(name: str, key: paramiko.PKey) -> None:
    """Record a host key on first contact (under the state lock; never replaces a key)."""
    with state.locked():
        keys = load_known_hosts()
        known = keys.lookup(name)
        if known is not None and key.get_name() in known:
            if known[key.get_name()] != key:
                raise paramiko.BadHostKeyException(name, key, known[key.get_name()])
            return
        keys.add(name, key.get_name(), key)
        _save_known_hosts(keys)


def _save_known_hosts(keys: paramiko.HostKeys) -> None:
    lines = []
    for entry in keys._entries:  # HostKeys.save writes in place; we want an atomic replace
        line = entry.to_line()
        if line:
            lines.append(line)
    atomic_write(known_hosts_path(), "".join(lines), 0o600)


def unpin(host: str, port: int | None) -> int:
    """Drop the pinned keys of a host (every port when none is given). Returns lines removed."""
    exact = host_key_name(host, port) if port else None
    with state.locked():
        keys = load_known_hosts()
        kept = []
        removed = 0
        for entry in keys._entries:
            hit = any(
                n == exact if exact else (n == host or re.fullmatch(rf"\[{re.escape(host)}\]:\d+", n))
                for n in entry.hostnames
            )
            if hit:
                removed += 1
            else:
                kept.append(entry)
        keys._entries = kept
        if removed:
            _save_known_hosts(keys)
    return removed


class KnownHostsMismatch(paramiko.BadHostKeyException):  # type: ignore[misc]  # paramiko ships no type information
    """First contact, but the user's own ~/.ssh/known_hosts holds another key for the host."""

    def __init__(self, hostname: str, got: paramiko.PKey, expected: paramiko.PKey, path: Path):
        super().__init__(hostname, got, expected)
        self.path = path


def user_known_hosts() -> Path:
    return Path.home() / ".ssh" / "known_hosts"


def user_known_key(hostname: str, kind: str) -> paramiko.PKey | None:
    """The key of this type that ~/.ssh/known_hosts (OpenSSH's own, hashed names too) has for
    the host, or None. A file paramiko cannot read is no evidence either way."""
    path = user_known_hosts()
    if not path.is_file():
        return None
    keys = paramiko.HostKeys()
    try:
        keys.load(str(path))
    except (OSError, ValueError, paramiko.SSHException, paramiko.hostkeys.InvalidHostKey):
        return None
    found = keys.lookup(hostname)
    return found.get(kind) if found is not None else None


def say_stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)  # sys.stderr at call time: the CLI's (or a test runner's)


class PinPolicy(paramiko.MissingHostKeyPolicy):  # type: ignore[misc]  # paramiko ships no type information
    """Unknown key: record it only when pinning is allowed (first contact in `up`), else refuse.

    On first contact the key is checked against the user's ~/.ssh/known_hosts (a host already
    known there must present that key), and its fingerprint is printed (SHA256:..., as ssh
    prints it) so it can be compared with what the provider's console shows. A changed pinned
    key never reaches the policy: paramiko raises BadHostKeyException itself because the pinned
    keys are loaded into the client before connecting.
    """

    def __init__(self, pin_new: bool, say: Callable[[str], None] = say_stderr):
        self.pin_new = pin_new
        self.say = say

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        if not self.pin_new:
            raise UnknownHostKey(hostname, key)
        known = user_known_key(hostname, key.get_name())
        if known is not None and known != key:
            raise KnownHostsMismatch(hostname, key, known, user_known_hosts())
        pin_host_key(hostname, key)
        where = " (the key your ~/.ssh/known_hosts has for it)" if known is not None else ""
        self.say(f"{hostname}: pinned host key {key.get_name()} {key.fingerprint}{where}")

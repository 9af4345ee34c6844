"""gpuctl's own known_hosts: host keys pinned on first contact, then enforced.

``known_hosts_path() -> Path``: gpuctl's known_hosts (OpenSSH format, under the state dir).
``host_key_name(address, port)``: how a host is named there. ``load_known_hosts()``: its keys.
``PinPolicy(pin_new)``: the paramiko policy for an unknown key: pinned when ``pin_new`` (only
`gpuctl up`, on first contact), else refused with UnknownHostKey. A changed key is always
refused (paramiko raises BadHostKeyException). ``unpin(host, port) -> int`` drops a host's
pinned keys (every port when port is None) and returns how many lines went.
"""

from __future__ import annotations

import re
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


class PinPolicy(paramiko.MissingHostKeyPolicy):  # type: ignore[misc]  # paramiko ships no type information
    """Unknown key: record it only when pinning is allowed (first contact in `up`), else refuse.

    A changed key never reaches the policy: paramiko raises BadHostKeyException itself
    because the pinned keys are loaded into the client before connecting.
    """

    def __init__(self, pin_new: bool):
        self.pin_new = pin_new

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        if not self.pin_new:
            raise UnknownHostKey(hostname, key)
        pin_host_key(hostname, key)

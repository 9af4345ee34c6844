"""The provider interface: typed records at the boundary, no dicts of Any.

A provider turns config into a recorded cluster (`up`), hands out a Node per machine
(`nodes`), removes what it created (`down`, idempotent, verified against the provider's own
list), and tells the node how to delete itself (`self_teardown`) for teardown after-train.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from provision.config import GpuctlConfig
from provision.remote import Node
from provision.state import ClusterRecord


@dataclass
class UpOptions:
    dry_run: bool = False
    assume_yes: bool = False
    confirm: Callable[[str], bool] = lambda _question: True
    say: Callable[[str], None] = print


@dataclass
class SelfTeardown:
    """What the node runs after the run to delete itself; secrets travel in `env`, never argv."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


class ProviderBackend(Protocol):
    def up(self, cfg: GpuctlConfig, opts: UpOptions) -> ClusterRecord | None: ...

    def nodes(self, cluster: ClusterRecord) -> list[Node]: ...

    def down(self, cluster: ClusterRecord, say: Callable[[str], None]) -> None: ...

    def self_teardown(self, cluster: ClusterRecord) -> SelfTeardown | None: ...

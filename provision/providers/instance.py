"""One cloud instance as the vendor describes it: what every vendor module parses its answer into.

Its own module, so the vendor modules, the shared flow (cloud.py), its abort and boot, and the
sweep all import it and the imports run one way.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Instance:
    """What the vendor says about one instance right now."""

    id: str
    state: str  # the vendor's own word, for messages
    ready: bool = False  # the vendor considers it running and gave an SSH address
    failed: bool = False  # a terminal state: it will never become ready
    address: str | None = None
    port: int = 22
    user: str = "root"
    label: str = ""
    private_address: str | None = None  # where the other nodes reach it (AWS: inside the VPC)
    host: str = ""  # the vendor's machine behind it, where its API names one (runpod: machineId)
    price_per_hour: float | None = None  # what the vendor bills it, where its API says (runpod: costPerHr)
    detail: str = ""  # the vendor's progress words while booting (Vast's status_msg: the image pull)

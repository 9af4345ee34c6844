"""The label every instance gpuctl creates carries: it marks the instance as gpuctl's and names
its cluster, so an instance whose record is gone (a killed `up`, a deleted state dir) is still
found and attributed (`gpuctl sweep`, `gpuctl down`).

`gpuctl-<cluster>-<node index>-<attempt>`: the Vast.ai label, the RunPod pod name, the AWS Name
tag (AWS also tags gpuctl-cluster=<cluster>). The attempt is 6 hex digits drawn per `up` (or
node replacement), so a create whose answer was lost is found by its exact label. Cluster names
are gpuctl's own (core/state.py's KEY_RE): the label parses from the right without ambiguity.
"""

from __future__ import annotations

import re
import secrets

LABEL_RE = re.compile(
    r"^gpuctl-(?P<cluster>[A-Za-z0-9][A-Za-z0-9._-]{0,127})-(?P<node>\d{1,4})-(?P<attempt>[0-9a-f]{6})$"
)


def new_labels(cluster: str, indices: list[int]) -> list[str]:
    """One label per node index, all of one new attempt."""
    attempt = secrets.token_hex(3)
    return [f"gpuctl-{cluster}-{i}-{attempt}" for i in indices]


def cluster_of(label: str) -> str | None:
    """The cluster a gpuctl label names; None for a label gpuctl did not make."""
    match = LABEL_RE.match(label or "")
    return match["cluster"] if match else None

"""The run's secrets: each rank reads them itself from the 0600 `secrets.env` beside run.json.

They never pass through the launcher's environment: DeepSpeed's runner copies every variable
whose name starts with MLFLOW, PYTHON, MV2 or UCX (NCCL on CUDA nodes) onto pdsh's command line
and logs that command into job.log, and its per-node launcher logs every variable with NCCL in
its name. So launch.sh starts the launcher without them (templates/launch.sh.j2) and each rank
loads this node's copy of the file before it does anything else. Once every rank has joined the
process group, every rank of every node has read its copy: local rank 0 deletes it then (on a
shared filesystem, the first one to get there) and, whatever happens, when it ends.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

from trainer.config import DistEnv, TrainerError

FILE = "secrets.env"
MAX_BYTES = 1 << 20  # what gpuctl writes is a few hundred bytes
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def parse(text: str) -> dict[str, str]:
    """NAME='value' words as provision/flows/render.py writes them (shlex.quote: bash reads the same).
    The errors name no value."""
    try:
        words = shlex.split(text)
    except ValueError:
        raise TrainerError(f"{FILE} is not NAME='value' lines (an unclosed quote)") from None
    values: dict[str, str] = {}
    for word in words:
        name, eq, value = word.partition("=")
        if not eq or not _NAME.match(name):
            raise TrainerError(f"{FILE} holds a word that is not NAME='value' (it was not written by gpuctl)")
        values[name] = value
    return values


def load(run_dir: Path) -> list[str]:
    """Put the file's values into this rank's environment (they win over inherited ones); the names."""
    try:
        with open(run_dir / FILE, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except FileNotFoundError:  # no secrets for this run, or a rank restarted after the file went
        return []
    if len(data) > MAX_BYTES:
        raise TrainerError(f"{FILE} is over {MAX_BYTES} bytes")
    values = parse(data.decode("utf-8", "surrogateescape"))
    os.environ.update(values)
    return sorted(values)


def drop(run_dir: Path, env: DistEnv) -> None:
    """The run dir's main rank (DistEnv.is_dir_main): delete this node's copy. Call it once every rank is
    past the group's rendezvous (or when this rank's run is over): by then every rank that will read it has."""
    if env.is_dir_main:
        (run_dir / FILE).unlink(missing_ok=True)

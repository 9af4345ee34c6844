"""Run events for the laptop's live view: phases before the first step and checkpoint states.

Rank 0 appends one JSON object per line to `events.jsonl` in the run dir:
  {"time": epoch, "kind": "phase", "name": "tokenizing data", "detail": "...", "expect_s": 90}
  {"time": epoch, "kind": "checkpoint", "tag": "step10", "state": "saving|saved|uploading|published|superseded", "bytes": N}
  ("superseded": a waiting upload skipped because a newer save replaced it; trainer/objstore/uploader.py)
gpuctl reads the file incrementally (provision/flows/watch.py); job.log keeps the full text.
Other ranks (and runs where start() was not called) write nothing. No torch here.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

EVENTS_FILE = "events.jsonl"
# What the first, uncached JIT build of DeepSpeed's CPU ops takes on a few cores (measured: 60-110 s).
COMPILE_EXPECT_S = 110

_lock = threading.Lock()  # the checkpoint uploader's thread writes too
_path: Path | None = None


def start(run_dir: Path, enabled: bool) -> None:
    """Rank 0 (enabled) writes run_dir/events.jsonl from here on; any other rank nothing."""
    global _path
    _path = run_dir / EVENTS_FILE if enabled else None


def emit(kind: str, **fields: object) -> None:
    if _path is None:
        return
    line = json.dumps({"time": round(time.time(), 3), "kind": kind, **fields}) + "\n"
    with _lock, _path.open("a") as handle:
        handle.write(line)  # one write of one line: the reader never sees half a record it keeps


def phase(name: str, detail: str = "", expect_s: float | None = None) -> None:
    """A phase of the run begins (it ends when the next one begins, or at the first step)."""
    emit("phase", name=name, detail=detail, **({"expect_s": expect_s} if expect_s else {}))


def checkpoint(tag: str, state: str, size: int | None = None) -> None:
    emit("checkpoint", tag=tag, state=state, **({"bytes": size} if size is not None else {}))


def ops_built(*names: str) -> bool:
    """Whether DeepSpeed's JIT ops (e.g. cpu_adam) are already built in TORCH_EXTENSIONS_DIR."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    return all(any(root.glob(f"**/{name}/{name}.so")) for name in names)


def ops_needed(ds_config: dict, *, at_init: bool) -> tuple[str, ...]:
    """The JIT ops DeepSpeed builds when it joins the process group (CPU ranks: the shared-memory
    allreduce) or at deepspeed.initialize (optimizer offloaded to CPU: CPU Adam)."""
    if at_init:
        offload = ds_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device")
        return ("cpu_adam",) if offload == "cpu" else ()
    from deepspeed.accelerator import get_accelerator

    return ("deepspeed_shm_comm",) if get_accelerator().device_name() == "cpu" else ()


def compile_phase(name: str, ops: tuple[str, ...]) -> None:
    """A phase that may JIT-compile DeepSpeed ops: says so, with the expected time, when one of them is
    neither prebuilt into DeepSpeed (the GPU image) nor built already in TORCH_EXTENSIONS_DIR."""
    try:
        from deepspeed.git_version_info import installed_ops
    except ImportError:  # no deepspeed here: nothing to say about its ops
        installed_ops = {}
    missing = [op for op in ops if not installed_ops.get(op) and not ops_built(op)]
    if missing:
        phase(name, f"compiling DeepSpeed ops {', '.join(missing)} (once)", COMPILE_EXPECT_S)
    else:
        phase(name)

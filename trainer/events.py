"""Run events for the laptop's live view: phases before the first step and checkpoint states.

Rank 0 appends one JSON object per line to `events.jsonl` in the run dir:
  {"time": epoch, "kind": "phase", "name": "tokenizing data", "detail": "...", "expect_s": 90}
  {"time": epoch, "kind": "outcome", "name": "ops", "detail": "cpu_adam cache hit"}  (how a phase went)
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
_began: list[tuple[str, float]] = []  # rank 0's phases as they began (summary.json's "phases")
_first_step: float | None = None  # when the first step ended: the last phase's end
outcomes: dict[str, str] = {}  # how each phase went, where it said (summary.json's "phase_notes")


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
    if _path is not None and _first_step is None:
        _began.append((name, time.time()))
    emit("phase", name=name, detail=detail, **({"expect_s": expect_s} if expect_s else {}))


def first_step_done() -> None:
    """The first step ended (called after every step; only the first counts)."""
    global _first_step
    if _first_step is None:
        _first_step = time.time()


def durations() -> dict[str, float]:
    """Seconds of each phase before the first step (a name seen twice: summed); {} on other ranks."""
    out: dict[str, float] = {}
    if not _began:
        return out
    ends = [t for _, t in _began[1:]] + [_first_step or time.time()]
    for (name, began), ended in zip(_began, ends, strict=True):
        out[name] = round(out.get(name, 0.0) + max(0.0, ended - began), 3)
    return out


def summary_fields() -> dict[str, object]:
    """summary.json's phases: seconds of each before the first step, and how each went where it said."""
    return {"phases": durations(), "phase_notes": dict(outcomes)}


def outcome(name: str, detail: str) -> None:
    """How the phase `name` went, once known (the "ops" phase: cache hit or compiled)."""
    if _path is not None:
        outcomes[name] = detail
    emit("outcome", name=name, detail=detail)


def model_phase(model: str) -> tuple[str, str]:
    """The model's phase: a Hub model is downloaded (unless the Hub cache has it) and loaded: "model
    download", the phase `up`'s first-step estimate names; the built-in tiny model and a local folder
    are only loaded."""
    if model == "tiny" or Path(model).expanduser().exists():
        return "loading model", model
    return "model download", f"{model} from the Hugging Face Hub (or its cache), then loaded"


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

"""What a run's node sends back, validated before gpuctl stores, shows or acts on any of it.

A rented node is someone else's computer and holds the bucket's write key: status.json,
summary.json, metrics.jsonl, events.jsonl and job.log are hostile input. Each record is checked
against a pydantic model (types, ranges, string lengths; every string scrubbed of terminal
escapes, core/terminal.py) and every read is bounded:
- status.json and summary.json: at most MAX_DOC_BYTES (a bigger one is ignored with one warning,
  never read into memory);
- job.log, metrics.jsonl, events.jsonl: at most READ_BYTES per read (the rest comes next read),
  lines cut at MAX_LINE characters; a metrics or events line that is no valid record is skipped
  (one warning per file);
- the copies `fetch_results` keeps: at most MAX_COPY_BYTES of metrics.jsonl, validated lines only.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from provision.core.terminal import scrub
from provision.transport import remote
from provision.transport.remote import TooLarge
from trainer.objstore.atomic import atomic_write

if TYPE_CHECKING:
    from pathlib import Path

    from provision.transport.remote import Node

MAX_DOC_BYTES = 1 << 20
READ_BYTES = remote.READ_BYTES  # what Tail asks of one read
MAX_LINE = 64 << 10
MAX_COPY_BYTES = 256 << 20
MAX_RANKS = 4096


def _cut(limit: int) -> Any:
    return AfterValidator(lambda s: scrub(s)[:limit])


Text = Annotated[str, _cut(300)]  # every string a node sends: scrubbed for a terminal, bounded
LongText = Annotated[str, _cut(4000)]  # summary.json's error: the last lines of a traceback
Epoch = Annotated[float, Field(ge=0, le=1e11, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0, le=10**15)]
Seconds = Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False)]
Figure = float  # loss, lr, rates: any float, NaN and inf included (a diverged run says so)


class Record(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class NodeStatus(Record):
    """status.json, written by launch.sh."""

    state: Literal["starting", "running", "succeeded", "failed", "cancelled"]
    exit_code: int | None = Field(default=None, ge=0, le=255)  # a shell's $?
    started_at: Epoch | None = None
    ended_at: Epoch | None = None
    pid: int | None = Field(default=None, ge=1, le=1 << 22)
    pgid: int | None = Field(default=None, ge=1, le=1 << 22)


class NodeSummary(Record):
    """summary.json, written by the trainer's rank 0 (trainer/loop.py summarize, or the error)."""

    state: Literal["succeeded", "failed"] | None = None
    run_id: Text | None = None
    strategy: Text | None = None
    steps: Count | None = None
    start_step: Count | None = None
    first_loss: Figure | None = None
    final_loss: Figure | None = None
    tokens_per_s: Figure | None = None
    tflops_per_gpu: Figure | None = None
    mfu: Figure | None = None
    peak_mem_gb: Annotated[list[Figure], Field(max_length=MAX_RANKS)] | Figure | None = None
    world_size: Annotated[int, Field(ge=1, le=MAX_RANKS)] | None = None
    global_batch: Count | None = None
    seq_len: Count | None = None
    params: Count | None = None
    precision: Text | None = None
    loss_scale: Figure | None = None
    skipped_steps: Count | None = None
    last_checkpoint: Text | None = None
    save_s: Annotated[list[Seconds], Field(max_length=100_000)] | None = None
    phases: Annotated[dict[Text, Seconds], Field(max_length=64)] | None = None  # before the first step
    phase_notes: Annotated[dict[Text, Text], Field(max_length=64)] | None = None  # ops: cache hit or compiled
    error: LongText | None = None


class NodeMetric(Record):
    """One line of metrics.jsonl (trainer/metrics.py StepRecord)."""

    step: Count
    loss: Figure | None = None
    lr: Figure | None = None
    tokens: Count | None = None
    tokens_per_s: Figure | None = None
    step_time_s: Figure | None = None
    tflops_per_gpu: Figure | None = None
    mfu: Figure | None = None
    peak_mem_gb: Annotated[list[Figure], Field(max_length=MAX_RANKS)] | None = None
    skipped: bool = False
    loss_scale: Figure | None = None
    skipped_steps: Count = 0
    fwd_bwd_s: Figure | None = None
    optimizer_s: Figure | None = None
    save_s: Figure | None = None
    time: Epoch | None = None


class NodeEvent(Record):
    """One line of events.jsonl (trainer/events.py)."""

    time: Epoch
    kind: Literal["phase", "checkpoint", "outcome"]
    name: Text | None = None  # phase, outcome
    detail: Text | None = None
    expect_s: Seconds | None = None
    tag: Text | None = None  # checkpoint
    state: Text | None = None
    bytes: Count | None = None


class BadRecord(Exception):
    """A record that is not what gpuctl writes: `why` names the field."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


def _why(err: ValidationError) -> str:
    first = err.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or "(the record)"
    return scrub(f"{field}: {first['msg']}")[:200]


def parse(model: type[Record], text: str) -> dict[str, Any]:
    """The record in `text` as a dict of checked values (the fields it has); BadRecord if it is none."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # JSONDecodeError, and ints of more than 4300 digits
        raise BadRecord("not JSON") from None
    if not isinstance(value, dict):
        raise BadRecord("not a JSON object")
    try:
        return model.model_validate(value).model_dump(exclude_unset=True)
    except ValidationError as err:
        raise BadRecord(_why(err)) from None


def parse_doc(model: type[Record], text: str | None) -> dict[str, Any]:
    """status.json / summary.json: {} when missing, empty or half written (the node rewrites it)."""
    if not text or not text.strip():
        return {}
    try:
        return parse(model, text)
    except BadRecord as bad:
        if bad.why == "not JSON":
            return {}  # caught mid-write, or garbage: nothing to show either way
        raise


def parse_lines(model: type[Record], lines: list[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """The valid records of some JSON lines, and why each other line was skipped (blank lines are no record)."""
    good: list[dict[str, Any]] = []
    bad: list[str] = []
    for line in lines:
        if not line.strip():
            continue
        if len(line) > MAX_LINE:
            bad.append(f"a line of {len(line):,} characters (at most {MAX_LINE:,})")
            continue
        try:
            good.append(parse(model, line))
        except BadRecord as err:
            bad.append(err.why)
    return good, bad


def log_line(line: str) -> str:
    """A job.log line as a terminal may show it."""
    return scrub(line[:MAX_LINE])


class Tail:
    """A growing file on the node, read from where the last read stopped, at most READ_BYTES a
    read (`more`: the read was full, more is there now); only whole lines come out, but a line
    that grows past MAX_LINE without an end comes out as it is rather than being held."""

    def __init__(self, path: str):
        self.path, self.offset, self.partial, self.more = path, 0, "", False

    def read(self, node: Node) -> list[str]:
        start = self.offset
        chunk, self.offset = node.read_new(self.path, self.offset, READ_BYTES)
        self.more = self.offset - start > READ_BYTES - 4  # (a cut character may leave up to 3 bytes)
        lines = (self.partial + chunk).split("\n")
        self.partial = lines.pop()  # "" after a final newline; else a line still being written
        if len(self.partial) > MAX_LINE:
            lines.append(self.partial)
            self.partial = ""
        return lines


def read_doc(node: Node, path: str, model: type[Record], notes: list[str]) -> dict[str, Any]:
    """status.json or summary.json, checked; {} (and a note) when it is too big or not what gpuctl writes."""
    name = path.rsplit("/", 1)[-1]
    try:
        return parse_doc(model, node.read_text(path, MAX_DOC_BYTES))
    except TooLarge as big:
        notes.append(f"warning: {name} on the node is {big.size:,} bytes (at most {big.limit:,}); not read")
    except BadRecord as bad:
        notes.append(f"warning: {name} from the node is not what gpuctl writes ({bad.why}); ignored")
    return {}


def copy_metrics(node: Node, path: str, target: Path, notes: list[str]) -> None:
    """metrics.jsonl's valid records, read in bounded pieces, at most MAX_COPY_BYTES of them."""
    tail, kept, skipped = Tail(path), list[str](), 0
    while tail.offset < MAX_COPY_BYTES:
        good, bad = parse_lines(NodeMetric, tail.read(node))
        kept += [json.dumps(record) + "\n" for record in good]
        skipped += len(bad)
        if not tail.more:
            break
    else:
        notes.append(f"warning: metrics.jsonl on the node is over {MAX_COPY_BYTES:,} bytes; kept the first")
    if skipped:
        notes.append(f"warning: metrics.jsonl from the node: {skipped} line(s) that are no valid record left out")
    if kept:
        atomic_write(target, "".join(kept))

"""BackgroundUploader: uploads checkpoints from a thread while training goes on.

Each node runs one (its local rank 0). Jobs run in submission order; every node
processes the same tags in the same order, so node 0's publish of a tag never waits
on a node that skipped it. A job is retried with exponential backoff while its error
is transient (store unreachable, 5xx, throttling), until ``retry_deadline`` seconds
after the job was submitted (default: the store's ``retry_deadline``, storage key
"retry_deadline", 3600 s); a permanent error (access denied, missing bucket) fails the
job at once. Every job gets at least one attempt.
Failures are remembered and raised by ``wait()``; later jobs still run.

Never falls behind silently: when saves come faster than uploads, a checkpoint still waiting
(not started) when a newer one is saved is superseded: dropped from the queue, logged and
reported to ``on_skip``, so at most one upload runs and at most one waits, per node. Which
tags to drop is agreed by every node at the save (trainer/checkpoint.py): ``hold()`` keeps
the worker from starting a waiting job and says the oldest waiting step; ``release(from_step)``
drops the waiting jobs from that step on. A tag dropped on one node is therefore never started
on any other, and node 0 never waits to publish a tag some node will not upload.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.objstore.backends import StorageError, UploadError

_log = logging.getLogger("gpuctl.objstore")

if TYPE_CHECKING:
    from trainer.objstore.store import CheckpointStore

# Uploads yield the CPU to training (CPU Adam with ZeRO-Offload, data loading, CPU ranks): the
# worker thread runs at this nice level, and the transfer threads it starts inherit it (Linux
# keeps nice per thread). Raising one's own nice needs no privilege.
UPLOAD_NICE = 10


def _yield_cpu() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), UPLOAD_NICE)
    except (AttributeError, OSError):  # not Linux/Unix: leave the priority alone
        pass


@dataclass(frozen=True)
class _Job:
    local_tag_dir: Path
    tag: str
    step: int
    world_size: int
    submitted: float  # time.monotonic() at submit: the retry deadline counts from here


class BackgroundUploader:
    """A daemon thread that uploads (and on node 0 publishes) submitted checkpoints."""

    def __init__(
        self,
        store: CheckpointStore,
        node_rank: int,
        num_nodes: int,
        log: Callable[[str], None] = print,
        *,
        retry_deadline: float | None = None,
        publish_timeout: float = 1800.0,
        backoff_initial: float = 1.0,
        backoff_max: float = 60.0,
        on_done: Callable[[str], None] | None = None,
        on_skip: Callable[[str], None] | None = None,
    ):
        self.store, self.node_rank, self.num_nodes, self.log = store, node_rank, num_nodes, log
        if retry_deadline is None:
            retry_deadline = getattr(store, "retry_deadline", 3600.0)
        self.retry_deadline, self.publish_timeout = retry_deadline, publish_timeout
        self.backoff_initial, self.backoff_max = backoff_initial, backoff_max
        self.on_done = on_done  # called with the tag once this node's upload (node 0: and publish) is done
        self.on_skip = on_skip  # called with the tag of a waiting upload that a newer save superseded
        self._waiting: deque[_Job] = deque()  # submitted, not started, oldest first
        self._held = False  # hold(): the worker starts no waiting job until release()
        self._cond = threading.Condition()
        self._pending: list[str] = []  # tags submitted and not finished, in order
        self._uploaded: set[str] = set()
        self._superseded: list[str] = []
        self._errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ckpt-upload-node{node_rank}", daemon=True)
        self._thread.start()

    # -- public API ----------------------------------------------------------------------
    def submit(self, local_tag_dir: Path, tag: str, step: int, world_size: int) -> None:
        """Queue a checkpoint for upload; returns at once."""
        if self._stop.is_set():
            raise UploadError("BackgroundUploader is closed")
        with self._cond:
            self._pending.append(tag)
            self._waiting.append(_Job(Path(local_tag_dir), tag, step, world_size, time.monotonic()))
            self._cond.notify_all()

    def hold(self) -> int | None:
        """Keep the worker from starting a waiting upload until release(); the oldest waiting step, if any."""
        with self._cond:
            self._held = True
            return self._waiting[0].step if self._waiting else None

    def release(self, from_step: int | None = None, by: str = "a newer save") -> list[str]:
        """End hold(); first drop the waiting uploads of step >= from_step (superseded by `by`). The dropped tags."""
        with self._cond:
            dropped = [j for j in self._waiting if from_step is not None and j.step >= from_step]
            for job in dropped:
                self._waiting.remove(job)
                self._pending.remove(job.tag)
                self._superseded.append(job.tag)
            self._held = False
            self._cond.notify_all()
        for job in dropped:
            self.log(
                f"checkpoint {job.tag}: upload skipped, superseded by {by} (saves come faster than uploads; "
                "the newer one goes to the store instead)"
            )
            if self.on_skip is not None:
                self.on_skip(job.tag)
        return [j.tag for j in dropped]

    def waiting_tags(self) -> list[str]:
        """Tags submitted and not started yet, oldest first."""
        with self._cond:
            return [j.tag for j in self._waiting]

    def superseded_tags(self) -> list[str]:
        """Tags whose upload was skipped because a newer save superseded them, oldest first."""
        with self._cond:
            return list(self._superseded)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every submitted checkpoint is done; raise UploadError on failures."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise UploadError(
                        f"checkpoint upload to {self.store.url} not finished after "
                        f"{timeout:.0f} s; still pending: {', '.join(self._pending)}"
                    )
                self._cond.wait(left)
            if self._errors:
                raise UploadError("; ".join(self._errors))

    def uploaded_tags(self) -> set[str]:
        """Tags whose files from this node are safely in the store (published, on node 0)."""
        with self._cond:
            return set(self._uploaded)

    def pending_tags(self) -> list[str]:
        """Tags submitted and not finished (uploading or queued), oldest first."""
        with self._cond:
            return list(self._pending)

    def wait_progress(self, timeout: float) -> None:
        """Block until one more submitted checkpoint finishes (or fails), at most timeout seconds."""
        with self._cond:
            left = len(self._pending)
            self._cond.wait_for(lambda: len(self._pending) < left, timeout)

    def errors(self) -> list[str]:
        with self._cond:
            return list(self._errors)

    def close(self, timeout: float | None = None) -> None:
        """Final sync, then stop the thread: wait(timeout), raising UploadError like it;
        the thread is stopped either way."""
        try:
            self.wait(timeout)
        finally:
            with self._cond:
                self._stop.set()
                self._cond.notify_all()
            self._thread.join(timeout=5)

    # -- worker --------------------------------------------------------------------------
    def _run(self) -> None:
        _yield_cpu()
        while (job := self._next()) is not None:
            error = None
            try:
                self._process(job)
            except StorageError as exc:
                error = f"upload of {job.tag} failed: {exc}"
                self.log(error)
            except Exception as exc:  # noqa: BLE001 - top of the worker: record, keep serving
                error = f"upload of {job.tag} failed: {type(exc).__name__}: {exc}"
                _log.exception("unexpected error uploading %s", job.tag)
                self.log(error)
            with self._cond:
                if error:
                    self._errors.append(error)
                else:
                    self._uploaded.add(job.tag)
                    if self.on_done is not None:
                        self.on_done(job.tag)
                self._pending.remove(job.tag)
                self._cond.notify_all()

    def _next(self) -> _Job | None:
        """The oldest waiting job once one may start; None once closed."""
        with self._cond:
            self._cond.wait_for(lambda: self._stop.is_set() or (bool(self._waiting) and not self._held))
            return None if self._stop.is_set() else self._waiting.popleft()

    def _process(self, job: _Job) -> None:
        # Counted from submission, so tags queued behind a long outage do not each get a
        # fresh deadline: the final sync ends within ~retry_deadline of the last submit.
        deadline = job.submitted + self.retry_deadline
        delay = self.backoff_initial
        attempt = 1
        t0 = time.monotonic()
        while not self._stop.is_set():
            try:
                self._attempt(job, deadline)
                self.log(
                    f"checkpoint {job.tag}: node {self.node_rank} upload done"
                    + (" and published" if self.node_rank == 0 else "")
                    + f" in {time.monotonic() - t0:.1f} s"
                )
                return
            except StorageError as exc:
                left = deadline - time.monotonic()
                if not exc.transient or left < delay or self._stop.is_set():
                    raise UploadError(
                        f"{exc} (gave up after {attempt} attempt(s), {time.monotonic() - t0:.0f} s)"
                    ) from exc
                self.log(f"checkpoint {job.tag}: attempt {attempt} failed: {exc}; retrying in {delay:.1f} s")
            self._stop.wait(delay)
            attempt += 1
            delay = min(delay * 2, self.backoff_max)
        raise UploadError(f"upload of {job.tag} cancelled (uploader closed)")

    def _attempt(self, job: _Job, deadline: float) -> None:
        self.store.upload_shards(job.local_tag_dir, job.tag, self.node_rank, step=job.step)
        if self.node_rank != 0:
            return
        timeout = max(1.0, min(self.publish_timeout, deadline - time.monotonic()))
        if not self.store.publish(job.tag, job.step, job.world_size, self.num_nodes, timeout):
            raise UploadError(
                f"checkpoint {job.tag} not published: other nodes did not finish uploading within {timeout:.0f} s"
            )

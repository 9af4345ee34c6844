"""Undoing a cloud `up` that was interrupted (Ctrl-C) or failed: terminate what it created.

The rules, for a user who pressed Ctrl-C on a paid instance:
- the abort answers the press at once ("interrupted: terminating ...") and is bounded by
  ABORT_S, vendor calls included: each call runs in a worker thread while the main thread
  watches the clock, so a hung vendor API (or boto3's own retries) cannot hold it;
- another Ctrl-C cannot cut the terminate calls short (it is answered with a line); it only
  stops the wait for the vendor to confirm the instances gone, whose terminate was accepted;
- whatever is not confirmed gone stays recorded in state -- a half-created instance found by
  this attempt's label included -- and the last line says `gpuctl down` finishes it.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from provision.core import interrupt, state
from provision.core.errors import GpuctlError, ProviderError
from provision.core.state import ClusterRecord, NodeRecord
from provision.providers.instance import Instance

ABORT_S = 60.0
POLL_S = 2.0  # between looks at the vendor's list
_T = TypeVar("_T")


class Vendor(Protocol):
    """The calls an abort makes on the vendor: what cloud.CloudBackend has (named by shape, so
    cloud.py imports this module and not the other way round)."""

    @property
    def kind(self) -> str: ...

    def list_instances(self, cluster: ClusterRecord) -> list[Instance]: ...

    def terminate(self, cluster: ClusterRecord, instance_id: str) -> None: ...

    def release(self, cluster: ClusterRecord, say: Callable[[str], None]) -> None: ...

    def forget_local(self, cluster: ClusterRecord) -> None: ...


class _Stop(Exception):
    """A Ctrl-C during a wait of the abort that may be cut short."""


class _OutOfTime(ProviderError):
    """The abort's ABORT_S ran out."""


class BoundedCalls:
    """The vendor calls of one abort, bounded together by ABORT_S. Each runs in a worker thread
    (a daemon: one still hung when gpuctl exits is dropped) while the main thread watches the
    clock and the Ctrl-C count, so a press is answered within 0.1 s."""

    def __init__(self, kind: str, shield: interrupt.Shield, say: Callable[[str], None]):
        self.kind, self.shield, self.say = kind, shield, say
        self.deadline = time.monotonic() + ABORT_S
        self.heard = 0  # presses answered so far

    def __call__(self, fn: Callable[[], _T], *, may_stop: bool = False) -> _T:
        [(value, error)] = self.each([fn], may_stop=may_stop)
        if error is not None:
            raise error
        return value  # type: ignore[no-any-return]

    def each(self, fns: list[Callable[[], Any]], *, may_stop: bool = False) -> list[tuple[Any, BaseException | None]]:
        """Run fns at once (one hung call does not keep the others from being sent); wait for all
        until the deadline. Returns (value, error) per fn; one still running then has _OutOfTime."""
        boxes: list[dict[str, Any]] = [{} for _ in fns]
        workers = [
            threading.Thread(target=_run_into, args=(fn, box), name="gpuctl-abort-call", daemon=True)
            for fn, box in zip(fns, boxes, strict=True)
        ]
        for worker in workers:
            worker.start()
        try:
            for worker in workers:
                while worker.is_alive():
                    self._watch(may_stop)
                    worker.join(0.1)
        except _OutOfTime as late:
            for worker, box in zip(workers, boxes, strict=True):
                if worker.is_alive():
                    box.setdefault("error", late)
        return [(box.get("value"), box.get("error")) for box in boxes]

    def nap(self, seconds: float) -> None:
        """Sleep between polls; a Ctrl-C or the deadline ends it (_Stop, _OutOfTime)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self._watch(may_stop=True)
            time.sleep(0.1)

    def _watch(self, may_stop: bool) -> None:
        if self.shield.presses > self.heard:
            self.heard = self.shield.presses
            if may_stop:
                raise _Stop
            left = max(0.0, self.deadline - time.monotonic())
            self.say(
                f"Ctrl-C: still terminating (at most {left:.0f} s more); stopping now would leave the instance running"
            )
        if time.monotonic() > self.deadline:
            raise _OutOfTime(
                f"{self.kind} did not answer within the {ABORT_S:.0f} s an abort may take",
                f"check the {self.kind} console",
            )


def _run_into(fn: Callable[[], Any], box: dict[str, Any]) -> None:
    try:
        box["value"] = fn()
    except BaseException as exc:  # noqa: BLE001  (handed to the main thread: BoundedCalls.each)
        box["error"] = exc


class UpAbort:
    """One abort of `up` on `backend` for `cluster` (the record as far as `up` got)."""

    def __init__(self, backend: Vendor, cluster: ClusterRecord, say: Callable[[str], None]):
        self.backend, self.kind, self.cluster, self.say = backend, backend.kind, cluster, say

    def run(self, created: list[str], labels: list[str], why: str) -> None:
        """Terminate `created` and any instance with one of `labels` that `created` misses."""
        interrupt.answered()  # this abort answers the Ctrl-C; from here on presses are counted
        with interrupt.shielded() as shield:
            calls = BoundedCalls(self.kind, shield, self.say)
            left, done = list(created), False
            try:
                created = created + self._strays(labels, created, calls)
                left = list(created)
                if created:
                    self.say(
                        f"{why}: terminating the {len(created)} instance(s) this attempt created "
                        f"(at most {ABORT_S:.0f} s)"
                    )
                left = self._terminate_all(created, calls)
                if not left and created:
                    left = self._confirm_gone(created, calls)
                if not left:
                    calls(lambda: self.backend.release(self.cluster, self.say))
                    done = True
            except GpuctlError as err:
                self.say(err.one_line())
            finally:  # a bug as well: what may be left stays recorded for `down`
                if done:
                    state.delete_cluster(self.cluster.name)
                    self.backend.forget_local(self.cluster)
                else:
                    self._keep_for_down(left)

    def _strays(self, labels: list[str], created: list[str], calls: BoundedCalls) -> list[str]:
        """Instances that carry this attempt's labels but were never recorded (a lost create answer)."""
        if not labels:
            return []
        try:
            listed = calls(lambda: self.backend.list_instances(self.cluster))
        except GpuctlError as err:
            self.say(
                f"warning: could not check {self.kind} for a half-created instance ({err.one_line()}); "
                f"look for labels gpuctl-{self.cluster.name}-* in the {self.kind} console"
            )
            return []
        found = [i for i in listed if i.label in labels and i.id not in created]
        for inst in found:  # its planned node gets the id (what `down` is then told to terminate)
            for node in self.cluster.nodes:
                if node.label == inst.label and not node.instance_id:
                    node.instance_id = inst.id
        return [i.id for i in found]

    def _terminate_all(self, ids: list[str], calls: BoundedCalls) -> list[str]:
        """Send a terminate for each id, all at once; returns the ids whose call failed."""
        results = calls.each([functools.partial(self.backend.terminate, self.cluster, i) for i in ids])
        left = []
        for instance_id, (_value, error) in zip(ids, results, strict=True):
            if error is None:
                continue
            if not isinstance(error, GpuctlError):
                raise error
            left.append(instance_id)
            self.say(f"could not terminate {self.kind} instance {instance_id}: {error.one_line()}")
        return left

    def _confirm_gone(self, ids: list[str], calls: BoundedCalls) -> list[str]:
        """Poll the vendor's list until ids are gone; returns those it still lists when a Ctrl-C
        or the deadline stops the wait (their terminate call was accepted)."""
        left = list(ids)
        try:
            while True:
                listed = calls(lambda: self.backend.list_instances(self.cluster), may_stop=True)
                left = sorted({i.id for i in listed} & set(ids))
                if not left:
                    return []
                calls.nap(POLL_S)
        except (_Stop, _OutOfTime) as stop:
            reason = "Ctrl-C: stopped waiting" if isinstance(stop, _Stop) else stop.message
            self.say(f"{reason}: {self.kind} still lists instance(s) {', '.join(left)} (their terminate was accepted)")
            return left

    def _keep_for_down(self, left: list[str]) -> None:
        """Record what may be left (a stray found by its label too), so `gpuctl down` finds it."""
        known = {n.instance_id for n in self.cluster.nodes}
        for instance_id in left:
            if instance_id not in known:
                host = f"node{len(self.cluster.nodes)}"
                self.cluster.nodes.append(NodeRecord(host=host, address="", instance_id=instance_id))
        state.save_cluster(self.cluster)
        what = f" with {self.kind} instance(s) {', '.join(left)}" if left else ""
        self.say(f"cluster {self.cluster.name} stays recorded{what}: run `gpuctl down` to finish removing it")

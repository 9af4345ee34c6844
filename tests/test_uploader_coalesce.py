"""Saves faster than uploads: the BackgroundUploader supersedes a waiting upload instead of queueing it.

Two nodes share a real file:// store; node 1's uploads are held at a gate (an injected delay: its link is
slower), so node 0 sits publishing while node 1 still uploads. The nodes agree on what to drop the way
trainer/checkpoint.py's Checkpointer.coalesce does (a MAX over the nodes of the oldest waiting step), so a
tag is only dropped where it waits on every node, node 0 never waits to publish a dropped tag, and the
newest save becomes `latest`. The run-level test (real DeepSpeed ranks, a throttled S3 server, a small
disk) is tests/test_trainer_end_of_run.py.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tests.fakes.harness import wait_until
from trainer.checkpoint import NOTHING_WAITING
from trainer.objstore.store import CheckpointStore
from trainer.objstore.uploader import BackgroundUploader

pytestmark = pytest.mark.timeout(120)


class Lines(list):
    def __call__(self, line: str) -> None:
        self.append(line)


def shards(root: Path, tag: str, node: int) -> Path:
    d = root / f"node{node}" / tag
    d.mkdir(parents=True)
    for r in (2 * node, 2 * node + 1):
        (d / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(tag.encode() * 1000)
    if node == 0:
        (d / "mp_rank_00_model_states.pt").write_bytes(b"w" * 4000)
    return d


def gated(store: CheckpointStore, gate: threading.Event) -> CheckpointStore:
    """The store with uploads that start only once the gate opens (a slow link, deterministically)."""
    upload = store.upload_shards

    def slow_upload(*args, **kwargs):
        assert gate.wait(60), "gate never opened"
        return upload(*args, **kwargs)

    store.upload_shards = slow_upload  # type: ignore[method-assign]
    return store


def coalesce(uploaders: list[BackgroundUploader], tag: str) -> list[list[str]]:
    """What every node does at the start of a save, with the collective MAX done here."""
    oldest = [up.hold() for up in uploaders]
    agreed = max(NOTHING_WAITING if o is None else o for o in oldest)
    return [up.release(agreed if agreed < NOTHING_WAITING else None, by=f"checkpoint {tag}") for up in uploaders]


def test_waiting_upload_is_superseded_on_every_node_and_the_newest_becomes_latest(tmp_path):
    cfg = {"url": f"file://{tmp_path / 'store'}", "keep": 5}
    gate1 = threading.Event()
    logs = [Lines(), Lines()]
    skipped: list[list[str]] = [[], []]
    ups = [
        BackgroundUploader(
            CheckpointStore.from_config(cfg) if n == 0 else gated(CheckpointStore.from_config(cfg), gate1),
            node_rank=n,
            num_nodes=2,
            log=logs[n],
            retry_deadline=60,
            on_skip=skipped[n].append,
        )
        for n in (0, 1)
    ]

    def save(step: int) -> list[list[str]]:
        dropped = coalesce(ups, f"step{step}")
        for n, up in enumerate(ups):
            up.submit(shards(tmp_path, f"step{step}", n), f"step{step}", step, world_size=4)
        return dropped

    assert save(10) == [[], []]
    # node 1 is uploading step10 (held at its gate); node 0 has uploaded it and waits to publish
    wait_until(lambda: not ups[0].waiting_tags() and not ups[1].waiting_tags(), 10, "step10 started on both")
    assert save(20) == [[], []]  # step10 is running on both: nothing waits anywhere, nothing dropped
    assert ups[0].pending_tags() == ups[1].pending_tags() == ["step10", "step20"]
    assert save(30) == [["step20"], ["step20"]]  # step20 waited on both nodes: superseded by step30
    assert ups[0].pending_tags() == ups[1].pending_tags() == ["step10", "step30"]  # bounded: 1 running, 1 waiting
    gate1.set()
    for up in ups:
        up.close(timeout=60)
    assert skipped == [["step20"], ["step20"]]
    assert all(up.uploaded_tags() == {"step10", "step30"} and up.superseded_tags() == ["step20"] for up in ups)
    assert any("checkpoint step20: upload skipped, superseded by checkpoint step30" in x for x in logs[1])
    store = CheckpointStore.from_config(cfg)
    assert store.latest().tag == "step30"
    assert [i.tag for i in store.list() if i.complete] == ["step30", "step10"]


def test_a_tag_running_on_one_node_is_not_dropped_on_another(tmp_path):
    """Node 0 has started step10 while it still waits on node 1: dropping it there would leave node 0's
    publish waiting for shards that never come, so the agreement keeps it."""
    cfg = {"url": f"file://{tmp_path / 'store'}", "keep": 5}
    gate0 = threading.Event()
    ups = [
        BackgroundUploader(gated(CheckpointStore.from_config(cfg), gate0), node_rank=0, num_nodes=2, log=Lines()),
        BackgroundUploader(CheckpointStore.from_config(cfg), node_rank=1, num_nodes=2, log=Lines()),
    ]
    ups[1].hold()  # node 1 is busy: its step10 waits
    ups[0].submit(shards(tmp_path, "step10", 0), "step10", 10, world_size=4)
    ups[1].submit(shards(tmp_path, "step10", 1), "step10", 10, world_size=4)
    wait_until(lambda: not ups[0].waiting_tags(), 10, "step10 started on node 0")
    assert coalesce(ups, "step20") == [[], []]  # node 0 has nothing waiting: step10 stays on node 1
    gate0.set()
    for up in ups:
        up.close(timeout=60)
    assert all(up.uploaded_tags() == {"step10"} and up.superseded_tags() == [] for up in ups)
    assert CheckpointStore.from_config(cfg).latest().tag == "step10"

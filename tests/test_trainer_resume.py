"""Resume continues exactly: same losses as an uninterrupted run (real DeepSpeed, 2 CPU ranks)."""

from __future__ import annotations

import json
import shutil

import pytest

from tests import test_trainer_helpers as h
from tests import test_trainer_ops_bucket as ops

pytest.importorskip("deepspeed")

WORLD, ACCUM, STEPS, AT = 2, 2, 6, 3
OPS = ("deepspeed_shm_comm", "cpu_adam")  # CPU ranks: the shared-memory allreduce, then CPU Adam


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resume_matches_uninterrupted_run(tmp_path):
    full = h.make_run_dir(tmp_path / "full", world=WORLD, grad_accum=ACCUM, max_steps=STEPS, checkpoint_every=AT)
    proc = h.launch(full, WORLD)
    assert proc.returncode == 0, proc.stdout[-3000:]
    uninterrupted = h.losses(full)
    assert sorted(uninterrupted) == list(range(1, STEPS + 1))
    assert uninterrupted[STEPS] < uninterrupted[1] - 0.3, uninterrupted  # it learns
    assert h.summary(full)["state"] == "succeeded"
    assert h.summary(full)["last_checkpoint"] == f"step{STEPS}"

    # The contract's resume form: an absolute save dir whose `latest` names the tag.
    saved = tmp_path / "saved"
    shutil.copytree(full / "checkpoints" / f"step{AT}", saved / f"step{AT}")
    (saved / "latest").write_text(f"step{AT}")
    resumed = h.make_run_dir(
        tmp_path / "resumed", world=WORLD, grad_accum=ACCUM, max_steps=STEPS, checkpoint_every=AT, resume=str(saved)
    )
    proc = h.launch(resumed, WORLD)
    assert proc.returncode == 0, proc.stdout[-3000:]
    after = h.losses(resumed)
    assert sorted(after) == list(range(AT + 1, STEPS + 1))
    for step, loss in after.items():
        assert loss == pytest.approx(uninterrupted[step], abs=1e-6), (step, after, uninterrupted)
    assert h.summary(resumed)["start_step"] == AT


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_with_other_world_size_fails_clearly(tmp_path):
    saved = tmp_path / "saved"
    (saved / "step3").mkdir(parents=True)
    (saved / "step3" / "trainer_state.json").write_text(
        json.dumps({"step": 3, "samples_seen": 12, "data_seed": 1234, "world_size": 3, "train_batch_size": 12})
    )
    (saved / "latest").write_text("step3")
    run = h.make_run_dir(tmp_path / "run", world=1, grad_accum=4, resume=str(saved))
    proc = h.launch(run, 1)
    assert proc.returncode != 0
    errors = [line for line in proc.stdout.splitlines() if line.startswith("trainer: error")]
    assert len(errors) == 1, proc.stdout[-3000:]
    assert "saved by 3 ranks but this run has 1" in errors[0]
    assert h.summary(run)["state"] == "failed"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_checkpoints_upload_prune_and_resume_from_store(tmp_path, monkeypatch):
    pytest.importorskip("trainer.objstore")
    from trainer.objstore.store import CheckpointStore

    storage = {"url": (tmp_path / "store").as_uri(), "endpoint_url": None, "region": None, "profile": None, "keep": 3}
    # The ranks' ops from the store's op cache (trainer/opscache.py), as on a fresh GPU node: the first
    # run finds them there (seeded with this machine's builds), the second has them on its disk.
    key = ops.node_key()
    ops.seed_from_first_run(CheckpointStore.from_config(storage).backend, key, tmp_path, OPS)
    monkeypatch.setenv("GPUCTL_OPS_CACHE", "1")
    monkeypatch.setenv("GPUCTL_OPS_DIR", str(tmp_path / "node-ops"))
    first = h.make_run_dir(
        tmp_path / "first",
        world=WORLD,
        grad_accum=ACCUM,
        max_steps=STEPS,
        checkpoint_every=2,
        keep_local=1,
        storage=storage,
    )
    proc = h.launch(first, WORLD)
    assert proc.returncode == 0, proc.stdout[-3000:]
    for op in OPS:  # one process of the node fetched each op; every rank loaded it from there
        assert proc.stdout.count(f"trainer: ops: cache hit {op}-{key} (") == 1, proc.stdout[-3000:]
    assert "compiled" not in proc.stdout
    store = CheckpointStore.from_config(storage)
    assert store.latest().tag == f"step{STEPS}" and store.latest().world_size == WORLD
    assert sorted(i.tag for i in store.list() if i.complete) == ["step2", "step4", "step6"]
    assert sorted(p.name for p in (first / "checkpoints").iterdir() if p.is_dir()) == [f"step{STEPS}"]

    second = h.make_run_dir(
        tmp_path / "second",
        world=WORLD,
        grad_accum=ACCUM,
        max_steps=STEPS,
        checkpoint_every=2,
        storage=storage,
        resume="step4",
    )
    proc = h.launch(second, WORLD)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "downloaded checkpoint step4" in proc.stdout
    assert "ops:" not in proc.stdout  # already on this node's disk
    before, after = h.losses(first), h.losses(second)
    assert sorted(after) == [5, 6]
    for step, loss in after.items():
        assert loss == pytest.approx(before[step], abs=1e-6), (step, after, before)

"""train.strategy fsdp for real: PyTorch FSDP2 on 3 CPU ranks over gloo, launched by torchrun.

One run through gpuctl on the local provider (falling loss, DCP checkpoints in the store, resume from
the store equal to the uninterrupted run, the HF export's loss on a logged batch), and the same model
and data under both engines (FSDP's losses equal DeepSpeed's).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests import test_trainer_helpers as h
from tests.helpers import LOSS_ON_BATCH, REPO, Gpuctl

pytestmark = pytest.mark.slow
STEPS, EVERY, SEQ = 6, 3, 64
ENGINE_TOLERANCE = 1e-5  # fp32, same seed and data order: the engines differ only in reduction order


def torchrun(run_dir: Path, world: int, timeout: float = 300) -> subprocess.CompletedProcess:
    """The single-node command torchrun.sh runs, without gpuctl (the engine comparison)."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1"]
    argv += ["--nproc_per_node", str(world), "--module", "trainer", "run.json"]
    with (run_dir / "job.log").open("w") as out:
        proc = subprocess.Popen(
            argv, cwd=run_dir, env=h.rank_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError((run_dir / "job.log").read_text()[-3000:]) from None
    return subprocess.CompletedProcess(argv, proc.returncode, (run_dir / "job.log").read_text())


@pytest.mark.timeout(600)
def test_fsdp_losses_match_deepspeed(tmp_path):
    losses = {}
    for strategy in ("deepspeed", "fsdp"):
        run_dir = h.make_run_dir(
            tmp_path / strategy, world=3, grad_accum=2, max_steps=4, offload=False, strategy=strategy
        )
        proc = (torchrun if strategy == "fsdp" else h.launch)(run_dir, 3)
        assert proc.returncode == 0, proc.stdout[-3000:]
        losses[strategy] = h.losses(run_dir)
        assert h.summary(run_dir)["strategy"] == strategy
    assert sorted(losses["fsdp"]) == sorted(losses["deepspeed"]) == [1, 2, 3, 4]
    for step, loss in losses["deepspeed"].items():
        assert abs(losses["fsdp"][step] - loss) <= ENGINE_TOLERANCE, (step, losses)
    assert losses["fsdp"][4] < losses["fsdp"][1] - 0.3  # and it learns


def run_losses(run_dir: str) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in map(json.loads, Path(run_dir, "metrics.jsonl").read_text().splitlines())}


@pytest.mark.timeout(900)
def test_local_fsdp_trains_resumes_from_the_store_and_exports(project, gpuctl: Gpuctl, tmp_path):
    assert gpuctl("init").returncode == 0
    cfg = yaml.safe_load((project / "gpuctl.yaml").read_text())
    cfg["train"].update(strategy="fsdp", max_steps=STEPS, checkpoint_every=EVERY, seq_len=SEQ)
    (project / "gpuctl.yaml").write_text(yaml.safe_dump(cfg))
    assert gpuctl("up").returncode == 0
    train = gpuctl("train")
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-2000:]
    run = json.loads(gpuctl("status", "--json").stdout)["run"]
    launch = Path(run["run_dir"], "launch.sh").read_text()
    assert "torchrun.sh" in launch and "deepspeed.launcher" not in launch
    first = run_losses(run["run_dir"])
    assert sorted(first) == list(range(1, STEPS + 1)) and first[STEPS] < first[1] * 0.9, first

    store = project / "gpuctl-storage"
    assert (store / "latest").read_text().strip() == f"step{STEPS}"
    shards = {p.name for p in (store / f"step{EVERY}").iterdir()}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "manifest.json"} <= shards
    cost = json.loads(gpuctl("plan", "--json").stdout)["checkpoint"]  # plan's size of an FSDP (DCP) save
    stored = sum(p.stat().st_size for p in (store / f"step{EVERY}").iterdir() if p.name != "manifest.json")
    assert cost["strategy"] == "fsdp" and stored == pytest.approx(cost["store_bytes"], rel=0.05), (stored, cost)

    resumed = gpuctl("train", "-v", "--resume-from", f"step{EVERY}")  # -v: job.log verbatim
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-2000:]
    assert f"downloaded checkpoint step{EVERY}" in resumed.stdout
    second = run_losses(json.loads(gpuctl("status", "--json").stdout)["run"]["run_dir"])
    assert sorted(second) == list(range(EVERY + 1, STEPS + 1))
    for step, loss in second.items():
        assert loss == pytest.approx(first[step], abs=1e-6), (step, second, first)

    hf = tmp_path / "hf"
    pull = gpuctl("ckpt", "pull", f"step{EVERY}", "--dest", str(tmp_path / "ckpt"), "--hf", str(hf))
    assert pull.returncode == 0, pull.stderr[-3000:]
    check = subprocess.run(
        [sys.executable, "-c", LOSS_ON_BATCH, str(hf), run["run_dir"], str(EVERY)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert check.returncode == 0, check.stderr[-3000:]
    loss = float(check.stdout.split()[-1])
    # the weights after step 3 are the ones step 4's forward pass used, on step 4's batch
    assert abs(loss - first[EVERY + 1]) < 1e-5, (loss, first)
    assert abs(loss - first[EVERY]) > 1e-3

    report = gpuctl("report", "-o", str(tmp_path / "rep"))
    assert report.returncode == 0, report.stderr
    assert "| fsdp |" in report.stdout
    assert gpuctl("down").returncode == 0

"""README command 1, for real: gpuctl init/up/train/status/down on the local provider.

Three CPU ranks under DeepSpeed ZeRO-2 with the optimizer offloaded to CPU, over gloo.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.fakes.harness import wait_until
from tests.helpers import Gpuctl

pytestmark = pytest.mark.slow


def write_config(project: Path, gpuctl: Gpuctl, **train) -> None:
    assert gpuctl("init").returncode == 0
    cfg = yaml.safe_load((project / "gpuctl.yaml").read_text())
    cfg["train"].update(train)
    (project / "gpuctl.yaml").write_text(yaml.safe_dump(cfg))


def group_members(pgid: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def shm_buffers(run_dir: str) -> set[str]:
    """This run's DeepSpeed CPU allreduce buffers (named by its master port; other tests' runs may be going)."""
    port = re.search(r"master port (\d+)", Path(run_dir, "job.log").read_text())
    assert port, "job.log names no master port"
    return {p.name for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port[1]}_*")}


def test_up_train_status_down(project, gpuctl, state_dir):
    write_config(project, gpuctl, max_steps=12, checkpoint_every=6)
    up = gpuctl("up")
    assert up.returncode == 0, up.stderr
    assert "predicted: step" in up.stdout + up.stderr  # plan's step-time model, before any step
    train = gpuctl("train")
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    assert "step 12/12" in train.stdout
    said = train.stdout + train.stderr
    assert "predicted: step" in said and "12 steps in" in said
    assert "forward+backward" in said and "optimizer step" in said  # predicted beside measured, at the end
    assert "[INFO]" not in train.stdout and "\x1b" not in train.stdout  # a pipe: plain lines, no launcher chatter

    status = json.loads(gpuctl("status", "--json").stdout)
    run = status["run"]
    assert run["state"] == "succeeded" and run["exit_code"] == 0
    assert run["steps"] == 12 and run["world_size"] == 3 and run["train_batch_size"] == 12
    assert run["tokens_per_s"] > 0
    assert shm_buffers(run["run_dir"]) == set()  # DeepSpeed's CPU allreduce buffers (69 MB a rank) are gone
    metrics = [json.loads(line) for line in Path(run["run_dir"], "metrics.jsonl").read_text().splitlines()]
    # the trainer times the parts plan models: forward + backward, the optimizer step, and each save
    assert all(m["fwd_bwd_s"] > 0 and m["optimizer_s"] > 0 for m in metrics)
    assert all(m["fwd_bwd_s"] + m["optimizer_s"] <= m["step_time_s"] * 1.01 for m in metrics)
    assert [m["step"] for m in metrics if m.get("save_s")] == [7]  # the save after step 6, on the next record
    summary = json.loads(Path(run["run_dir"], "summary.json").read_text())
    assert len(summary["save_s"]) == 2 and all(s > 0 for s in summary["save_s"])
    first, last = metrics[0]["loss"], metrics[-1]["loss"]
    assert last < first * 0.8, (first, last)  # the loss falls
    assert abs(run["final_loss"] - last) < 1e-6

    store = project / "gpuctl-storage"
    assert (store / "latest").read_text().strip() == "step12"
    assert (store / "step12" / "manifest.json").is_file() and (store / "step6" / "manifest.json").is_file()
    shards = list((store / "step12").rglob("*.pt"))
    assert any("optim_states" in s.name for s in shards) and any("model_states" in s.name for s in shards)

    report = gpuctl("report", "-o", "rep")
    assert report.returncode == 0, report.stderr
    assert "| 3 CPU ranks | 12 |" in report.stdout and run["run_id"] in report.stdout
    assert "predicted vs measured" in report.stdout and "step (saves apart)" in report.stdout
    from PIL import Image

    with Image.open(project / "rep" / "report.png") as png:
        assert png.size[0] > 600 and png.size[1] > 300

    ls = json.loads(gpuctl("ckpt", "ls", "--json").stdout)
    assert [c["tag"] for c in ls if c["complete"]] == ["step12", "step6"]

    down = gpuctl("down")
    assert down.returncode == 0, down.stderr
    assert json.loads(gpuctl("status", "--json").stdout)["cluster"] is None
    assert gpuctl("report", run["run_id"], "-o", "rep2").returncode == 0  # after down too
    assert not list(state_dir.glob("clusters/*.json"))


def test_down_stops_a_running_run(project, gpuctl, state_dir):
    write_config(project, gpuctl, max_steps=400, checkpoint_every=0)
    assert gpuctl("up").returncode == 0
    started = gpuctl("train", "--detach")
    assert started.returncode == 0, started.stderr
    run_id = started.stdout.strip()
    record = json.loads((state_dir / "runs" / f"{run_id}.json").read_text())
    wait_until(lambda: Path(record["run_dir"], "metrics.jsonl").exists(), 300, "the first step")
    assert len(group_members(record["pgid"])) >= 4  # launch.sh, launcher, 3 ranks (400 steps: minutes to go)
    down = gpuctl("down")
    assert down.returncode == 0, down.stderr
    assert group_members(record["pgid"]) == []
    assert shm_buffers(record["run_dir"]) == set()  # killed ranks leave no /dev/shm buffer either
    status = json.loads(Path(record["run_dir"], "status.json").read_text())
    assert status["state"] == "cancelled"
    assert not list(state_dir.glob("clusters/*.json"))


def test_failed_run_exit_code_and_run_command(project, gpuctl, state_dir):
    (project / "corpus.txt").write_text("")  # no tokens: the trainer must fail clearly
    write_config(project, gpuctl, data="corpus.txt", max_steps=2)
    result = gpuctl("run", "--yes")
    assert result.returncode != 0
    status_files = list(Path(state_dir, "local-node", "runs").glob("*/status.json"))
    assert len(status_files) == 1
    status = json.loads(status_files[0].read_text())
    assert status["state"] == "failed" and status["exit_code"] == result.returncode
    assert not list(state_dir.glob("clusters/*.json"))  # `run` took the cluster down

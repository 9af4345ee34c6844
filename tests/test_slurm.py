"""provider.kind slurm against a real Slurm (tests/slurm.py: slurmctld + two slurmd on loopback).

Slurm is the engine: `up` checks the login node and holds nothing (runtime bootstrap: it builds the venv
in a job), `train` submits one batch job (srun starts each node's launcher, CPU ranks of the tiny model),
the live view shows the job's queue state,
`cancel` is scancel and `down` cancels the cluster's jobs. Each test ends with squeue empty.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import subprocess
import sys
import threading
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

from tests import test_trainer_helpers as h
from tests.fakes.harness import wait_until
from tests.fakes.preempt import freeze_past_a_checkpoint, signal_run
from tests.helpers import Gpuctl
from tests.slurm import GPUS, NODES
from trainer.hostenv import ops_cache_default


def write_config(
    project: Path, gpuctl: Gpuctl, workdir: Path, provider: dict | None = None, top: dict | None = None, **train
) -> None:
    """gpuctl.yaml for the test's Slurm; `top`: whole sections to replace (storage, recovery, secrets)."""
    assert gpuctl("init", "--force").returncode == 0
    cfg = yaml.safe_load((project / "gpuctl.yaml").read_text())
    cfg.update(top or {})
    workdir.mkdir(parents=True, exist_ok=True)
    cfg["provider"] = {
        "kind": "slurm",
        "login": "local",
        "partition": "debug",
        "cpu_ranks": 2,
        "cpus_per_task": 2,
        "time": "0:20:00",
        "workdir": str(workdir),
        "python": sys.executable,
        **(provider or {}),
    }
    cfg["train"].update(train)
    (project / "gpuctl.yaml").write_text(yaml.safe_dump(cfg))


def doctor_jobs(slurm, name: str = "doctor") -> dict[str, str]:
    """gpuctl's short jobs of that name (the doctor's, the bootstrap install's) that Slurm still remembers
    (finished ones too: MinJobAge), by job id."""
    out = slurm.sh("scontrol", "show", "job", "--oneliner").stdout
    return {line.split()[0]: line for line in out.splitlines() if f"JobName=gpuctl-{name} " in line}


def test_up_checks_the_login_node_and_holds_nothing(project, gpuctl: Gpuctl, slurm, tmp_path, state_dir):
    write_config(project, gpuctl, tmp_path / "shared", {"partition": "nope"})
    bad = gpuctl("up")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "provider.partition 'nope'" in bad.stderr

    write_config(project, gpuctl, tmp_path / "shared", {"workdir": str(tmp_path / "missing")})
    bad = gpuctl("up")
    assert bad.returncode != 0 and "provider.workdir" in bad.stderr

    write_config(project, gpuctl, tmp_path / "shared", {"nodes": 3})
    bad = gpuctl("up")
    assert bad.returncode != 0 and "provider.nodes is 3 but the partition has 2 node(s)" in bad.stderr, bad.stderr

    write_config(project, gpuctl, tmp_path / "shared", {"runtime": "bootstrap", "python": "/opt/none/python3"})
    bad = gpuctl("up")  # the install job finds no such python on the compute node: one line, nothing recorded
    assert bad.returncode != 0 and "slurm: the image has no /opt/none/python3" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr and not list((state_dir / "clusters").glob("*.json"))

    write_config(project, gpuctl, tmp_path / "shared", {"cpus_per_task": 64})  # more than any node has
    bad = gpuctl("up")
    assert bad.returncode != 0 and "Slurm refuses the job shape" in bad.stderr, bad.stderr

    write_config(project, gpuctl, tmp_path / "shared", {"gpus_per_node": GPUS + 1})  # sinfo's gres has fewer
    bad = gpuctl("up")
    assert bad.returncode != 0 and f"provider.gpus_per_node is {GPUS + 1} but 0 node(s)" in bad.stderr, bad.stderr
    # the site's way of asking for GPUs (select/cons_tres here: --gpus-per-node), or the one the config names;
    # sbatch --test-only accepts either, and the record keeps it for every job
    for ask, flag, kept in (("auto", "--gpus-per-node", "gpus-per-node"), ("gres", "--gres gpu:N", "gres")):
        write_config(project, gpuctl, tmp_path / "shared", {"gpus_per_node": GPUS, "gpu_request": ask})
        up = gpuctl("up", "--skip-doctor")  # doctor checks the login node, which has no GPU (nor nvidia-smi) here
        assert up.returncode == 0 and f"GPUs as {flag}" in up.stderr, up.stderr
        record = json.loads(next((state_dir / "clusters").glob("*.json")).read_text())
        assert record["slurm"]["gpu_request"] == kept
        assert gpuctl("down").returncode == 0

    write_config(project, gpuctl, tmp_path / "shared")
    before = doctor_jobs(slurm)
    up = gpuctl("up")
    assert up.returncode == 0, up.stderr
    assert "sbatch --test-only accepts the job" in up.stderr
    # up's quick checks ran as a short job on the partition (srun), not on the login node, and it ended
    new = {job: line for job, line in doctor_jobs(slurm).items() if job not in before}
    assert len(new) == 1 and "JobState=COMPLETED" in next(iter(new.values())), new
    record = json.loads(next((state_dir / "clusters").glob("*.json")).read_text())
    assert record["provider"] == "slurm" and record["slurm"]["partition"] == "debug"
    assert slurm.jobs() == []  # no allocation is held while idle
    assert gpuctl("down").returncode == 0
    assert not list((state_dir / "clusters").glob("*.json"))


@pytest.mark.slow
def test_train_on_slurm_succeeds_with_falling_loss(project, gpuctl: Gpuctl, slurm, tmp_path, s3_server, fresh_bucket):
    top = {
        "secrets": ["HF_TOKEN"],
        "storage": {"url": f"s3://{fresh_bucket}/slurm", "endpoint_url": s3_server.endpoint},
    }
    shape = {"max_steps": 8, "checkpoint_every": 4, "micro_batch": 1, "grad_accum": 2}
    # one rank on each of the cluster's two nodes, in the venv `up` builds on the shared filesystem over this
    # suite's Python (its torch is the pinned CPU one); the ranks reuse this venv's DeepSpeed ops (else a build)
    two_nodes = {"nodes": 2, "cpu_ranks": 1, "runtime": "bootstrap"}
    top["env"] = {"TORCH_EXTENSIONS_DIR": ops_cache_default(dict(os.environ))}
    write_config(project, gpuctl, tmp_path / "shared", two_nodes, top=top, **shape)
    token = "tok-" + secrets.token_hex(8)
    before = doctor_jobs(slurm, "bootstrap")
    up = gpuctl("up", "--skip-doctor")
    venv = tmp_path / "shared" / "venv"
    assert up.returncode == 0 and f"slurm: node side installed in {venv}" in up.stderr, up.stderr[-3000:]
    assert f"the image's torch {version('torch')}" in up.stderr  # used, not reinstalled
    installs = [line for job, line in doctor_jobs(slurm, "bootstrap").items() if job not in before]
    assert len(installs) == 1 and "JobState=COMPLETED" in installs[0]  # on a compute node, through Slurm
    train = gpuctl("train", "-v", env={"HF_TOKEN": token, "AWS_SECRET_ACCESS_KEY": token + "aws"})  # moto takes any
    assert train.returncode == 0, train.stdout[-4000:] + train.stderr[-2000:]
    # the batch script ran under Slurm (job log), with the rendezvous on the first node's NodeAddr
    assert "gpuctl: Slurm job" in train.stdout and "(master 127.0.0.1)" in train.stdout
    # srun started a launcher on each node at Slurm's node rank, and the hostfile is Slurm's node list
    for rank, node in enumerate(NODES):
        assert f"gpuctl: node rank {rank} on {node} starts 1 rank(s) with deepspeed" in train.stdout
    status = json.loads(gpuctl("status", "--json").stdout)["run"]
    assert status["state"] == "succeeded" and status["steps"] == 8 and status["world_size"] == 2
    run_dir = Path(status["run_dir"])
    assert run_dir.is_relative_to(tmp_path / "shared")
    assert (run_dir / "hostfile").read_text() == "".join(f"{node} slots=1\n" for node in NODES)
    assert f"{venv}/bin/python -u -m trainer.slurm_node deepspeed 1" in (run_dir / "launch.sh").read_text()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert not (run_dir / "secrets.env").exists()  # the ranks read it and it went
    assert stored_tags(s3_server, fresh_bucket, "slurm/") == {"step4", "step8"}  # complete checkpoints in S3
    # one run dir for both nodes: rank 0 alone uploads it, both ranks' optimizer shards, once
    listed = s3_server.client().list_objects_v2(Bucket=fresh_bucket, Prefix="slurm/step8/")["Contents"]
    keys = {obj["Key"].removeprefix("slurm/step8/") for obj in listed}
    assert {k for k in keys if k.startswith("_nodes/")} == {"_nodes/0.json"}
    assert {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)} <= keys, keys
    assert "node 1 upload done" not in train.stdout
    assert slurm.jobs() == []
    # sbatch copies the submitting shell's environment into the job by default, and slurmctld keeps it
    # in its state files: gpuctl names what travels, so no secret of its shell reaches Slurm's disk
    assert not [p for p in slurm.root.rglob("*") if p.is_file() and token.encode() in p.read_bytes()]
    assert token not in train.stdout + train.stderr
    assert gpuctl("down").returncode == 0  # forgets the cluster; the venv on the shared filesystem stays
    again = gpuctl("up", "--skip-doctor")  # the same pins: kept, not built again
    assert again.returncode == 0 and "node side already installed" in again.stderr, again.stderr
    assert gpuctl("down").returncode == 0


@pytest.mark.slow
def test_pending_shows_its_reason_cancel_and_down_leave_no_job(project, gpuctl: Gpuctl, slurm, tmp_path, state_dir):
    write_config(project, gpuctl, tmp_path / "shared", max_steps=4)
    assert gpuctl("up").returncode == 0
    blocker = slurm.sh("sbatch", "--parsable", "--exclusive", "--nodes=2", "--wrap", "sleep 600").stdout.strip()
    wait_until(lambda: f"{blocker} RUNNING None" in slurm.jobs(), 30, "the blocking job to run")

    follow = subprocess.Popen(
        [sys.executable, "-m", "provision.cli", "train"],  # the plain view (a pipe)
        cwd=project,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(follow.stdout or []), daemon=True)
        reader.start()
        wait_until(lambda: any("PENDING (Resources)" in line for line in lines), 120, "the queue state in the view")
        ours = [job for job in slurm.jobs() if not job.startswith(blocker)]
        assert len(ours) == 1 and "PENDING" in ours[0]
        # never requeued from step 0 by a site's JobRequeue=1 (the job would train again over its own run dir)
        assert "Requeue=0" in slurm.sh("scontrol", "show", "job", ours[0].split()[0]).stdout

        cancel = gpuctl("cancel")
        assert cancel.returncode == 0, cancel.stderr
        assert [job for job in slurm.jobs() if not job.startswith(blocker)] == []
        assert follow.wait(timeout=60) != 0
        reader.join(timeout=10)
        shown = "".join(lines)
        assert "phase: slurm: Slurm job" in shown and "CANCELLED" in shown and "cancelled" in shown, shown
    finally:
        slurm.sh("scancel", blocker)
        if follow.poll() is None:
            follow.kill()
            follow.wait()

    # a second run, started detached and running: `down` cancels it
    run_id = gpuctl("train", "--detach").stdout.strip().splitlines()[-1]
    wait_until(lambda: any("RUNNING" in job for job in slurm.jobs()), 60, "the second run's job to run")
    down = gpuctl("down")
    assert down.returncode == 0, down.stderr
    assert slurm.jobs() == []
    assert json.loads((state_dir / "runs" / f"{run_id}.json").read_text())["state"] == "cancelled"


@pytest.mark.slow
def test_train_through_an_ssh_login_node(project, gpuctl: Gpuctl, slurm, tmp_path, tmp_path_factory):
    """gpuctl on a laptop, Slurm's commands on the login node over SSH (a real sshd whose sessions
    find this Slurm through SLURM_CONF, as a login node's profile would)."""
    from tests.sshd import SSHD

    login = SSHD(tmp_path_factory.mktemp("login"), session_env={"SLURM_CONF": str(slurm.conf)}).start()
    try:
        provider = {"login": login.host("127.0.0.2"), "identity_file": str(login.client_key)}
        write_config(project, gpuctl, tmp_path / "shared", provider, max_steps=4, checkpoint_every=0)
        env = {"SLURM_CONF": "/nonexistent"}  # the laptop has no Slurm: every command goes over SSH
        up = gpuctl("up", env=env)
        assert up.returncode == 0, up.stderr
        assert "sbatch --test-only accepts the job" in up.stderr
        train = gpuctl("train", "-v", env=env)
        assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-2000:]
        assert "gpuctl: Slurm job" in train.stdout
        assert json.loads(gpuctl("status", "--json", env=env).stdout)["run"]["state"] == "succeeded"
        assert gpuctl("down", env=env).returncode == 0
        assert slurm.jobs() == []
    finally:
        login.stop()


@pytest.mark.slow
def test_the_walltime_warning_saves_a_checkpoint_and_stops(project, gpuctl: Gpuctl, slurm, tmp_path, state_dir):
    """sbatch --signal=USR1@N: Slurm's warning before the walltime reaches the ranks (scancel --signal sends
    it the same way, to every process of the job's steps), which save one checkpoint together and stop."""
    write_config(project, gpuctl, tmp_path / "shared", max_steps=5000, checkpoint_every=0)
    assert gpuctl("up").returncode == 0
    run_id = gpuctl("train", "--detach").stdout.strip().splitlines()[-1]
    run = json.loads((state_dir / "runs" / f"{run_id}.json").read_text())
    job_id, run_dir = run["pgid"], Path(run["run_dir"])
    metrics = run_dir / "metrics.jsonl"
    wait_until(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 3, 240, "three steps")
    slurm.sh("scancel", "--signal", "USR1", str(job_id))
    wait_until(lambda: slurm.jobs() == [], 120, "the job to end")
    status = json.loads(gpuctl("status", "--json").stdout)["run"]
    assert status["state"] == "failed" and status["exit_code"] == 75, status  # not a success: it stopped early
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["state"] == "stopped" and summary["stopped_by"] == "SIGUSR1"
    step = summary["steps"]
    assert 3 <= step < 5000 and summary["last_checkpoint"] == f"step{step}"
    assert "saved step" in (run_dir / "job.log").read_text()
    assert any(p.name == f"step{step}" for p in (project / "gpuctl-storage").rglob("*"))  # uploaded
    assert gpuctl("down").returncode == 0


def stored_tags(s3_server, bucket: str, prefix: str) -> set[str]:
    """The tags with a manifest in the bucket (complete or not)."""
    listed = s3_server.client().list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return {obj["Key"][len(prefix) :].split("/")[0] for obj in listed if obj["Key"].endswith("manifest.json")}


def newest_stored_step(s3_server, bucket: str, prefix: str) -> int:
    """The newest tag's step with a manifest in the bucket (0: none yet)."""
    return max((int(tag.removeprefix("step")) for tag in stored_tags(s3_server, bucket, prefix)), default=0)


def started_run_dirs(shared: Path) -> set[Path]:
    """The run dirs under the Slurm workdir whose ranks have logged a step (job.log beside metrics.jsonl)."""
    return {log.parent for log in shared.rglob("job.log") if (log.parent / "metrics.jsonl").is_file()}


@pytest.mark.slow
def test_a_requeued_job_resumes_with_the_losses_of_an_uninterrupted_run(
    project, gpuctl: Gpuctl, slurm, tmp_path, s3_server, fresh_bucket
):
    """Slurm requeues the job (scontrol requeue: what a preemption or a node failure does) and runs the batch
    script again: the ranks resume from the newest complete checkpoint in S3, whose credentials reach the
    restart through the kept 0600 secrets file, gone once the run is over. The follow sees one run."""
    shape = {"max_steps": 30, "checkpoint_every": 3, "micro_batch": 1, "grad_accum": 2}
    write_config(project, gpuctl, tmp_path / "shared", top={"storage": {"url": "ref-store"}}, **shape)
    assert gpuctl("up").returncode == 0
    assert gpuctl("train").returncode == 0
    reference = json.loads(gpuctl("status", "--json").stdout)["run"]["run_dir"]
    uninterrupted = h.losses(Path(reference))

    storage = {"url": f"s3://{fresh_bucket}/rq", "endpoint_url": s3_server.endpoint}
    top = {"storage": storage, "recovery": {"max_restarts": 1}}
    write_config(project, gpuctl, tmp_path / "shared", top=top, **shape)
    follow = subprocess.Popen(
        [sys.executable, "-m", "provision.cli", "train"],
        cwd=project,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_until(lambda: started_run_dirs(tmp_path / "shared") - {Path(reference)}, 240, "the run to start")
        (run_dir,) = started_run_dirs(tmp_path / "shared") - {Path(reference)}
        # stopped once the bucket holds a checkpoint and steps remain (on the tiny model a run outpaces its
        # uploads: requeued later, it would have nothing left to resume); a requeue kills what it stopped
        newest = functools.partial(newest_stored_step, s3_server, fresh_bucket, "rq/")
        ranks = functools.partial(signal_run, run_dir, by_cmdline=True)  # not slurmstepd, not the batch shell
        losses, _stored = freeze_past_a_checkpoint(run_dir, newest, ranks, timeout=240, last_step=shape["max_steps"])
        stopped = max(losses)
        (job,) = [line.split()[0] for line in slurm.jobs()]
        slurm.sh("scontrol", "requeue", job)  # kills the stopped ranks and queues the job again
        held = ("Restarts=1", "JobState=PENDING", "Reason=BeginTime")  # an earlier update is overwritten
        wait_until(lambda: all(w in slurm.sh("scontrol", "show", "job", job).stdout for w in held), 60, "the requeue")
        assert Path(json.loads(gpuctl("status", "--json").stdout)["run"]["run_dir"]) == run_dir
        kept = run_dir / "secrets.keep"
        assert kept.is_file() and kept.stat().st_mode & 0o777 == 0o600  # for the restart, owner-only
        slurm.sh("scontrol", "update", f"JobId={job}", "StartTime=now")  # Slurm holds a requeued job ~2 min
        wait_until(lambda: "Reason=BeginTime" not in slurm.sh("scontrol", "show", "job", job).stdout, 30, "the hold")
        out, _ = follow.communicate(timeout=300)
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait()
    assert follow.returncode == 0, out[-4000:]
    log = (run_dir / "job.log").read_text()
    assert "requeued the job (restart 1 of 1)" in log and "resumed from" in log, log[-3000:]
    resumed_at = int(log.split("resumed from", 1)[1].split("at step", 1)[1].split()[0])
    assert 3 <= resumed_at <= stopped and resumed_at % 3 == 0, (resumed_at, stopped)
    assert json.loads(gpuctl("status", "--json").stdout)["run"]["state"] == "succeeded"
    after = h.losses(run_dir)  # a step trained again after the resume: its last line
    assert sorted(after) == list(range(1, 31))
    for step, loss in after.items():
        assert loss == pytest.approx(uninterrupted[step], abs=1e-6), (step, after, uninterrupted)
    assert not list(run_dir.glob("secrets.*"))  # the run is over: no copy of its secrets is left
    assert slurm.jobs() == []
    assert gpuctl("down").returncode == 0

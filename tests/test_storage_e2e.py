"""`gpuctl up && gpuctl train` with storage s3://bucket/prefix on a real S3-protocol server
(moto_server behind tests/s3server.py's cutting proxy, loopback only), CLI as a subprocess.

One uninterrupted reference run (12 steps, checkpoints every 4) leaves step4/8/12 in the bucket;
the other tests resume from it, corrupt it, export it, and check nothing leaked. The credentials
live only in a named profile (storage.profile) whose secret is a marker string: the node can
only reach the bucket through the AWS_* env gpuctl hands over, and the marker must not show up
in the state dir, job.log, gpuctl's output or any process's argv.
"""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests import test_trainer_helpers as helpers
from tests.fakes.harness import wait_until
from tests.helpers import GPUCTL, LOSS_ON_BATCH, REPO, Gpuctl
from tests.s3server import LatestWatcher, MotoS3, venv_bin

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
pytest.importorskip("deepspeed")

PROFILE = "gpuctl-e2e"
KEY_ID = "AKIAE2ETESTKEY000001"
MARKER = "e2eSECRETmarker9f8e7d6c5b4a3210SECRET"  # the secret key; must never show up
STEPS, EVERY = 12, 4


# -- helpers ---------------------------------------------------------------------------------
def cli_env(home: Path, state: Path) -> dict[str, str]:
    """gpuctl's environment: credentials only in a named profile, no AWS_* keys, own state dir."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    home.mkdir(parents=True, exist_ok=True)
    (home / "credentials").write_text(f"[{PROFILE}]\naws_access_key_id = {KEY_ID}\naws_secret_access_key = {MARKER}\n")
    (home / "config").write_text(f"[profile {PROFILE}]\nregion = us-east-1\n")
    env.update(
        AWS_SHARED_CREDENTIALS_FILE=str(home / "credentials"),
        AWS_CONFIG_FILE=str(home / "config"),
        AWS_EC2_METADATA_DISABLED="true",
        GPUCTL_STATE_DIR=str(state),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        # the suite's op cache (tests/run.sh builds it first): a folder of its own would build both ops again
        TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions")),
    )
    return env


TOOL_CREDS = {"aws_access_key_id": "AKIATOOLS", "aws_secret_access_key": "tools"}  # any key works on moto


def tool_env() -> dict[str, str]:
    """For aws-cli / s5cmd / plain boto3: any key works against moto."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_ACCESS_KEY_ID=TOOL_CREDS["aws_access_key_id"],
        AWS_SECRET_ACCESS_KEY=TOOL_CREDS["aws_secret_access_key"],
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
        AWS_CONFIG_FILE="/dev/null",
        AWS_SHARED_CREDENTIALS_FILE="/dev/null",
    )
    return env


@dataclass
class Project:
    dir: Path
    env: dict[str, str]
    # gpuctl in dir with exactly env; fails the test on a non-zero exit unless check=False
    gpuctl: Gpuctl = field(init=False)

    def __post_init__(self) -> None:
        self.gpuctl = Gpuctl(self.dir, self.env, check=True)

    @property
    def outputs(self) -> list[str]:
        """Everything gpuctl printed, for the leak check."""
        return self.gpuctl.outputs

    @property
    def state(self) -> Path:
        return Path(self.env["GPUCTL_STATE_DIR"])

    def newest_run(self) -> dict:
        return json.loads(self.gpuctl("status", "--json").stdout)["run"]


def make_project(root: Path, server: MotoS3, bucket: str, *, cpu_ranks: int = 3, **train) -> Project:
    root.mkdir(parents=True)
    project = Project(root, cli_env(root / "aws", root / "state"))
    project.gpuctl("init")
    cfg = yaml.safe_load((root / "gpuctl.yaml").read_text())
    cfg["provider"]["cpu_ranks"] = cpu_ranks
    cfg["train"].update({"seq_len": 64, "max_steps": STEPS, "checkpoint_every": EVERY, **train})
    cfg["storage"].update(
        url=f"s3://{bucket}/runs/e2e", endpoint_url=server.endpoint, region="us-east-1", profile=PROFILE, keep=3
    )
    (root / "gpuctl.yaml").write_text(yaml.safe_dump(cfg))
    project.gpuctl("up")
    return project


def losses(run_dir: str | Path) -> dict[int, float]:
    lines = Path(run_dir, "metrics.jsonl").read_text().splitlines()
    return {rec["step"]: rec["loss"] for rec in map(json.loads, lines)}


def assert_same_losses(resumed: dict[int, float], reference: dict[int, float], first: int) -> None:
    assert sorted(resumed) == list(range(first, STEPS + 1)), resumed
    for step, loss in resumed.items():
        assert abs(loss - reference[step]) < 1e-5, (step, resumed, reference)


class ArgvWatch:
    """Samples every process's argv while a run goes on; records any that holds the marker."""

    def __init__(self):
        self.hits: list[str] = []
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(0.3):
            self.samples += 1
            for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
                try:
                    argv = cmdline.read_bytes()
                except OSError:
                    continue
                if MARKER.encode() in argv:
                    self.hits.append(argv.replace(b"\0", b" ").decode(errors="replace")[:200])


def objects(server: MotoS3, bucket: str, prefix: str) -> dict[str, dict]:
    client = server.client()
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for obj in page.get("Contents", ()):
            out[obj["Key"][len(prefix) + 1 :]] = {
                "size": obj["Size"],
                "etag": obj["ETag"],
                "mtime": obj["LastModified"].timestamp(),
            }
    return out


# -- the reference run -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with MotoS3(proxy=True, log_dir=tmp_path_factory.mktemp("moto")) as srv:
        yield srv


@dataclass
class Reference:
    project: Project
    bucket: str
    prefix: str
    run: dict
    losses: dict[int, float]
    train_output: str
    argv_hits: list[str]
    argv_samples: int
    latest_seen: list[str]
    latest_violations: list[str]
    objects: dict[str, dict]


@pytest.fixture(scope="module")
def reference(server, tmp_path_factory) -> Reference:
    bucket = server.make_bucket()
    project = make_project(tmp_path_factory.mktemp("ref") / "project", server, bucket)
    with (
        ArgvWatch() as argv,
        LatestWatcher(server, bucket, "runs/e2e", limit_s=3600, interval_s=0.2, **TOOL_CREDS) as latest,
    ):
        train = project.gpuctl("train")
    run = project.newest_run()
    return Reference(
        project,
        bucket,
        "runs/e2e",
        run,
        losses(run["run_dir"]),
        train.stdout + train.stderr,
        argv.hits,
        argv.samples,
        latest.seen,
        latest.violations,
        objects(server, bucket, "runs/e2e"),
    )


# -- tests -----------------------------------------------------------------------------------
def test_run_leaves_complete_checkpoints_in_the_bucket(reference, server):
    ref = reference
    assert ref.run["state"] == "succeeded" and ref.run["steps"] == STEPS
    assert f"step {STEPS}/{STEPS}" in ref.train_output
    assert ref.losses[STEPS] < ref.losses[1] * 0.8  # it learns
    tags = [f"step{s}" for s in range(EVERY, STEPS + 1, EVERY)]
    for tag in tags:
        assert f"{tag}/manifest.json" in ref.objects and f"{tag}/mp_rank_00_model_states.pt" in ref.objects
        assert sum(f"{tag}/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" in ref.objects for r in range(3)) == 3
    assert server.client().get_object(Bucket=ref.bucket, Key="runs/e2e/latest")["Body"].read() == b"step12"
    assert not ref.latest_violations and ref.latest_seen[-1] == "step12", ref.latest_seen

    url = f"s3://{ref.bucket}/runs/e2e/"
    aws = subprocess.run(
        [venv_bin("aws"), "--endpoint-url", server.endpoint, "s3", "ls", "--recursive", url],
        env=tool_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert aws.returncode == 0, aws.stderr
    s5 = subprocess.run(
        [venv_bin("s5cmd"), "--endpoint-url", server.endpoint, "ls", url + "*"],
        env=tool_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert s5.returncode == 0, s5.stderr
    for tag in tags:
        for listing in (aws.stdout, s5.stdout):
            assert f"{tag}/manifest.json" in listing and f"{tag}/mp_rank_00_model_states.pt" in listing

    ls = json.loads(ref.project.gpuctl("ckpt", "ls", "--json").stdout)
    assert [(c["tag"], c["complete"], c["world_size"]) for c in ls] == [(t, True, 3) for t in reversed(tags)]
    assert {c["size"] for c in ls} and all(c["size"] > 1_000_000 for c in ls)


def test_no_secret_in_state_logs_output_or_argv(reference):
    ref = reference
    run_dir = Path(ref.run["run_dir"])
    marker = MARKER.encode()
    leaks = [str(p) for p in ref.project.state.rglob("*") if p.is_file() and marker in p.read_bytes()]
    assert leaks == []
    assert run_dir.is_relative_to(ref.project.state)  # local provider: the node's run dir was searched too
    assert not (run_dir / "secrets.env").exists() and not (run_dir / ".deepspeed_env").exists()
    assert marker not in (run_dir / "job.log").read_bytes()
    assert not [o for o in ref.project.outputs if MARKER in o]
    assert ref.argv_samples > 5 and ref.argv_hits == []
    storage = json.loads((run_dir / "run.json").read_text())["storage"]
    assert storage["profile"] is None and MARKER not in json.dumps(storage)
    # The uploads worked although the node's boto3 had no profile to use (run.json names none and
    # the shared credentials file holds only the named one): the handed-over AWS_* env did it.


def test_resume_from_tag_continues_the_same_losses(reference, server):
    ref = reference
    before = objects(server, ref.bucket, ref.prefix)
    out = ref.project.gpuctl("train", "--resume-from", "step4")
    assert "resuming from step4 (step 4)" in out.stderr
    run = ref.project.newest_run()
    assert run["state"] == "succeeded" and run["run_id"] != ref.run["run_id"]
    log = Path(run["run_dir"], "job.log").read_text()
    assert "downloaded checkpoint step4 (step 4)" in log and "resumed from" in log
    assert_same_losses(losses(run["run_dir"]), ref.losses, EVERY + 1)
    # Re-saved step8/step12: files identical to the stored ones are not uploaded again.
    after = objects(server, ref.bucket, ref.prefix)
    shards = [k for k in before if k.startswith(("step8/", "step12/")) and k.endswith(".pt")]
    unchanged = [k for k in shards if after[k]["etag"] == before[k]["etag"]]
    not_resent = [k for k in unchanged if after[k]["mtime"] == before[k]["mtime"]]
    # The resumed run is bit-exact, so at least the model states come out byte-identical
    # (DeepSpeed's optimizer shards differ in bytes, not in values).
    assert "step12/mp_rank_00_model_states.pt" in unchanged, (before, after)
    assert not_resent == unchanged, (unchanged, not_resent)


def test_bad_shards_fall_back_to_the_previous_complete_checkpoint(reference, server):
    """step12 (latest): a shard with the right size but wrong bytes; step8: a shard missing.
    `--resume` must detect both, say so in job.log, and continue from step4."""
    ref = reference
    client = server.client()
    key12 = f"{ref.prefix}/step12/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    size = client.head_object(Bucket=ref.bucket, Key=key12)["ContentLength"]
    client.put_object(Bucket=ref.bucket, Key=key12, Body=b"\0" * size)
    client.delete_object(Bucket=ref.bucket, Key=f"{ref.prefix}/step8/mp_rank_00_model_states.pt")

    ref.project.gpuctl("train", "--resume")
    run = ref.project.newest_run()
    assert run["state"] == "succeeded"
    log = Path(run["run_dir"], "job.log").read_text()
    assert (
        "checkpoint step12 failed verification" in log and "falling back to previous complete checkpoint step8" in log
    )
    assert "checkpoint step8 failed verification" in log and "falling back to previous complete checkpoint step4" in log
    assert "downloaded checkpoint step4 (step 4)" in log
    assert_same_losses(losses(run["run_dir"]), ref.losses, EVERY + 1)


def test_other_world_size_is_refused_before_anything_ships(reference, server, tmp_path):
    project = make_project(tmp_path / "two", server, reference.bucket, cpu_ranks=2)
    out = project.gpuctl("train", "--resume", check=False, timeout=120)
    assert out.returncode != 0
    assert "was saved by 3 ranks but cluster" in out.stderr and "has 2; resume needs the same world size" in out.stderr
    assert not list((project.state / "runs").glob("*.json"))  # no run started


def test_trainer_refuses_other_world_size_before_downloading(reference, server, tmp_path, monkeypatch):
    """The node's own check (a run started without gpuctl's): one rank, a 3-rank checkpoint."""
    for key, value in tool_env().items():
        if key.startswith("AWS_"):
            monkeypatch.setenv(key, value)
    storage = {
        "url": f"s3://{reference.bucket}/{reference.prefix}",
        "endpoint_url": server.endpoint,
        "region": "us-east-1",
        "profile": None,
        "keep": 3,
    }
    run_dir = helpers.make_run_dir(
        tmp_path / "one", world=1, grad_accum=4, seq_len=64, storage=storage, resume="latest"
    )
    proc = helpers.launch(run_dir, 1, timeout=300)
    assert proc.returncode != 0
    errors = [line for line in proc.stdout.splitlines() if line.startswith("trainer: error")]
    assert len(errors) == 1 and "was saved by 3 ranks but this run has 1" in errors[0], proc.stdout[-3000:]
    assert not list(run_dir.glob("checkpoints/*/*.pt"))  # refused before fetching anything


def test_pull_hf_folder_loads_and_matches_the_trained_loss(reference, tmp_path):
    """Weights of step4 give, through from_pretrained, the loss the engine logged at step 5
    (computed in step 5's forward pass with exactly those weights, on the same batch)."""
    ref = reference
    dest, hf = tmp_path / "ckpt", tmp_path / "hf"
    ref.project.gpuctl("ckpt", "pull", "step4", "--dest", str(dest), "--hf", str(hf))
    assert (dest / "latest").read_text() == "step4" and (hf / "model.safetensors").is_file()
    check = subprocess.run(
        [sys.executable, "-c", LOSS_ON_BATCH, str(hf), ref.run["run_dir"], str(EVERY)],
        env=ref.project.env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert check.returncode == 0, check.stderr[-3000:]
    loss = float(check.stdout.split()[-1])
    assert abs(loss - ref.losses[EVERY + 1]) < 1e-5, (loss, ref.losses)
    assert abs(loss - ref.losses[EVERY]) > 1e-3  # a wrong checkpoint (or batch) would not match


def test_pull_shows_a_progress_bar_with_speed(reference, tmp_path):
    """Under a terminal `gpuctl ckpt pull` draws rich's bar with bytes and bytes/s."""
    master, slave = pty.openpty()
    env = {**reference.project.env, "COLUMNS": "120", "TERM": "xterm"}
    proc = subprocess.Popen(
        [*GPUCTL, "ckpt", "pull", "--dest", str(tmp_path / "p")],
        cwd=reference.project.dir,
        env=env,
        stdin=slave,
        stdout=slave,
        stderr=slave,
    )
    os.close(slave)
    seen = b""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    assert proc.wait(timeout=30) == 0, seen[-2000:]
    text = seen.decode(errors="replace")
    assert "download" in text and "/s" in text and "MB" in text, text[-2000:]
    assert "pulled step" in text


def test_storage_outage_mid_run(server, tmp_path):
    """The S3 endpoint refuses connections (and live ones are cut) from step 1 on: training goes
    on to the end, uploads are retried, the run is not done until the server is back and the last
    checkpoint is synced, and `latest` never names an incomplete checkpoint."""
    bucket = server.make_bucket()
    project = make_project(tmp_path / "project", server, bucket, max_steps=10, checkpoint_every=5)
    with LatestWatcher(server, bucket, "runs/e2e", limit_s=3600, interval_s=0.2, **TOOL_CREDS) as latest:
        run_id = project.gpuctl("train", "--detach").stdout.strip()
        run_dir = Path(json.loads((project.state / "runs" / f"{run_id}.json").read_text())["run_dir"])
        log = run_dir / "job.log"
        steps = lambda: len(losses(run_dir)) if (run_dir / "metrics.jsonl").exists() else 0  # noqa: E731
        wait_until(lambda: steps() >= 1, 300, "the first step", every=0.2)
        server.outage()
        try:
            cut_at = steps()
            wait_until(
                lambda: (
                    "waiting for checkpoint uploads" in log.read_text()
                    and "checkpoint step5: attempt 1 failed" in log.read_text()
                ),
                240,
                "training to end while down",
                every=0.2,
            )
            assert steps() == 10 and cut_at < 5  # steps kept coming while the store was down
            assert json.loads((run_dir / "status.json").read_text())["state"] == "running"  # final sync pending
            time.sleep(2)
            assert json.loads((run_dir / "status.json").read_text())["state"] == "running"
        finally:
            server.recover()
        project.gpuctl("logs", "-f", timeout=300)  # follows to the end; fails on a failed run
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "succeeded", log.read_text()[-3000:]
    text = log.read_text()
    assert "checkpoint step5: node 0 upload done and published" in text
    assert "checkpoint step10: node 0 upload done and published" in text
    assert text.index("checkpoint step5: attempt 1 failed") < text.index("checkpoint step5: node 0 upload done")
    stored = objects(server, bucket, "runs/e2e")
    assert "step5/manifest.json" in stored and "step10/manifest.json" in stored
    assert server.client().get_object(Bucket=bucket, Key="runs/e2e/latest")["Body"].read() == b"step10"
    assert not latest.violations and latest.seen and latest.seen[-1] == "step10", latest.seen

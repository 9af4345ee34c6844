"""`gpuctl doctor` for real: the local provider and the loopback SSH hosts (CPU ranks over gloo),
storage on moto's S3 server, a small tmpfs as /dev/shm or as the node's disk, and the offers filter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import Gpuctl

EXTENSIONS = os.environ.get(
    "TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions")
)
GPU_CHECKS = {"GPUs", "driver / CUDA", "ECC errors", "Xid errors", "PCIe link", "P2P topology"}


@pytest.fixture
def small_fs(tmp_path):
    """A tmpfs of the given size in MB, mounted for the test (root only) and unmounted after."""
    mounted: list[Path] = []

    def make(name: str, size_mb: int) -> Path:
        where = tmp_path / name
        where.mkdir()
        out = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(where)], capture_output=True
        )
        if out.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {out.stderr.decode().strip()}")
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def write(project: Path, provider: dict, *, name: str, env: dict | None = None, storage: dict | None = None) -> None:
    cfg = {
        "name": name,
        "provider": provider,
        "train": {"max_steps": 2, "checkpoint_every": 0},
        "storage": storage or {"url": str(project / "store")},
        "env": {"TORCH_EXTENSIONS_DIR": EXTENSIONS, **(env or {})},
    }
    (project / "gpuctl.yaml").write_text(yaml.safe_dump(cfg))


def ssh_provider(sshd, workdir: Path) -> dict:
    return {
        "kind": "ssh",
        "hosts": [sshd.host()],
        "identity_file": str(sshd.client_key),
        "python": sys.executable,
        "cpu_ranks": 3,
        "workdir": str(workdir),
        "authorized_keys": str(sshd.authorized_keys),
        "ready_timeout": 30,
    }


def rows_by_check(doc: dict) -> dict[str, dict]:
    return {row["check"]: row for row in doc["rows"]}


def assert_full_cpu_table(rows: dict[str, dict]) -> None:
    """Every check that applies ran and passed or warned; the GPU ones are n/a on CPU ranks."""
    assert {rows[c]["status"] for c in GPU_CHECKS} == {"n/a"}
    for check in ("shared memory", "disk (checkpoints)", "clock offset", "torch", "deepspeed"):
        assert rows[check]["status"] == "pass", rows[check]
    assert rows["host RAM"]["status"] in ("pass", "warn")  # warn: other work holds the memory plan asks for
    assert rows["CPU cores"]["status"] in ("pass", "warn")  # 2 cores for 3 CPU Adam ranks here: warn
    assert rows["CPU Adam op"]["status"] == "pass", rows["CPU Adam op"]
    allreduce = rows["all-reduce (gloo, 3 ranks, 32 MB)"]
    assert allreduce["status"] == "pass", allreduce
    algbw, busbw = (float(part.split()[1]) for part in allreduce["value"].split(", "))
    assert busbw == pytest.approx(algbw * 2 * 2 / 3, rel=0.02) and algbw > 0  # busbw = algbw x 2(n-1)/n
    assert rows["storage put/get/delete"]["status"] == "pass", rows["storage put/get/delete"]
    assert rows["storage throughput (64 MB)"]["status"] in ("pass", "warn")
    # the step-time model's rates, measured on the node (trainer/doctor_rates.py)
    assert rows["disk write rate"]["status"] in ("pass", "warn") and "MB/s" in rows["disk write rate"]["value"]
    assert "M params/s per rank" in rows["CPU Adam throughput"]["value"]
    assert rows["host<->device copy"]["status"] == "n/a"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_local_up_runs_quick_checks_and_doctor_measures_gloo(project, gpuctl: Gpuctl):
    write(project, {"kind": "local", "cpu_ranks": 3}, name="doc-local")
    up = gpuctl("up", check=True, timeout=300)
    assert "quick checks:" in up.stderr and "0 fail" not in up.stderr
    full = gpuctl("doctor", "--json", check=True, timeout=900)
    doc = json.loads(full.stdout)
    assert doc["quick"] is False
    assert_full_cpu_table(rows_by_check(doc))
    assert "forward+backward (model shape)" in rows_by_check(doc)  # gpuctl.yaml's model: plan knows its shape
    plan = json.loads(gpuctl("plan", "--json", check=True).stdout)["step_time"]
    assert {"compute", "grad reduce", "cpu adam", "framework/micro"} <= set(plan["measured_terms"])
    status = gpuctl("status", check=True, env={"COLUMNS": "200"})
    assert "doctor (checks" in status.stdout and "fail" not in status.stdout.split("doctor (")[1].splitlines()[0]
    gpuctl("down", "--yes", check=True)


def test_small_dev_shm_stops_up_and_train_until_fixed(project, gpuctl: Gpuctl, small_fs, state_dir):
    shm = small_fs("shm", 64)
    write(project, {"kind": "local", "cpu_ranks": 3}, name="doc-shm", env={"GPUCTL_SHM_DIR": str(shm)})
    up = gpuctl("up", timeout=300, env={"COLUMNS": "250"})
    assert up.returncode == 8, up.stderr
    assert "shared memory" in up.stderr and "64 MB" in up.stderr and "--shm-size" in up.stderr, up.stderr
    assert "error: cluster doc-shm is up but failed 1 check(s): localhost: shared memory" in up.stderr
    record = json.loads((state_dir / "clusters" / "doc-shm.json").read_text())
    assert [r["check"] for r in record["doctor"]["rows"] if r["status"] == "fail"] == ["shared memory"]

    train = gpuctl("train", timeout=120)
    assert train.returncode == 1 and "failed its checks: localhost: shared memory" in train.stderr
    assert "--force" in train.stderr and not list((state_dir / "runs").glob("*.json"))
    status = gpuctl("status", check=True, env={"COLUMNS": "250"})
    assert "fail: localhost: shared memory" in status.stdout

    write(project, {"kind": "local", "cpu_ranks": 3}, name="doc-shm")  # the ranks' shm back on /dev/shm
    again = gpuctl("doctor", "--quick", "--json", timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    record = json.loads((state_dir / "clusters" / "doc-shm.json").read_text())
    assert record["doctor"]["quick"] and not [r for r in record["doctor"]["rows"] if r["status"] == "fail"]
    gpuctl("down", "--yes", check=True)


def test_run_takes_the_cluster_down_when_its_checks_fail(project, gpuctl: Gpuctl, small_fs, state_dir):
    shm = small_fs("shm", 32)
    write(project, {"kind": "local", "cpu_ranks": 3}, name="doc-run", env={"GPUCTL_SHM_DIR": str(shm)})
    run = gpuctl("run", "--yes", timeout=300)
    assert run.returncode == 8 and "shared memory" in run.stderr and "cluster doc-run is down" in run.stderr
    assert not (state_dir / "clusters" / "doc-run.json").exists() and not list((state_dir / "runs").glob("*.json"))


def test_ssh_node_with_a_full_disk_fails_with_the_fix(project, gpuctl: Gpuctl, sshd, small_fs):
    disk = small_fs("disk", 16)
    (disk / "filler").write_bytes(b"\0" * (15 << 20))  # the file system is (nearly) full
    write(project, ssh_provider(sshd, disk / "gpuctl"), name="doc-disk")
    up = gpuctl("up", timeout=120, env={"COLUMNS": "250"})
    assert up.returncode == 8, up.stdout + up.stderr
    assert "disk (checkpoints)" in up.stderr and "train.keep_local" in up.stderr, up.stderr
    doc = json.loads(gpuctl("doctor", "--quick", "--json", timeout=120).stdout)
    disk_row = rows_by_check(doc)["disk (checkpoints)"]
    assert disk_row["status"] == "fail" and str(disk) in disk_row["value"]
    gpuctl("down", "--yes", check=True)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ssh_doctor_runs_every_check_with_s3_storage(project, gpuctl: Gpuctl, sshd, s3_server, fresh_bucket):
    storage = {"url": f"s3://{fresh_bucket}/runs/doc", "endpoint_url": s3_server.endpoint}
    write(project, ssh_provider(sshd, project / "node"), name="doc-ssh", storage=storage)
    gpuctl("up", check=True, timeout=300)
    doc = json.loads(gpuctl("doctor", "--json", check=True, timeout=900).stdout)
    rows = rows_by_check(doc)
    assert_full_cpu_table(rows)
    assert rows["storage put/get/delete"]["value"] == f"s3://{fresh_bucket}/runs/doc: ok"
    assert "Contents" not in s3_server.client().list_objects_v2(Bucket=fresh_bucket)  # the probe objects are gone
    gpuctl("down", "--yes", check=True)


def test_storage_the_node_cannot_write_fails_with_the_fix(project, gpuctl: Gpuctl, s3_server, s3_env):
    storage = {"url": "s3://no-such-bucket/x", "endpoint_url": s3_server.endpoint}
    write(project, {"kind": "local", "cpu_ranks": 3}, name="doc-s3", storage=storage)
    up = gpuctl("up", "--skip-doctor", check=True, timeout=120)
    assert "quick checks" not in up.stderr and "checking" not in up.stderr
    quick = gpuctl("doctor", "--quick", "--json", timeout=120)
    assert quick.returncode == 1
    row = rows_by_check(json.loads(quick.stdout))["storage put/get/delete"]
    assert row["status"] == "fail" and "no-such-bucket" in row["value"] and "credentials" in row["fix"]
    s3_env.delenv("AWS_ACCESS_KEY_ID")  # no credentials on the laptop: that row fails, the others still run
    s3_env.delenv("AWS_SECRET_ACCESS_KEY")
    bare = json.loads(gpuctl("doctor", "--quick", "--json", timeout=120).stdout)
    rows = rows_by_check(bare)
    assert (
        rows["storage put/get/delete"]["status"] == "fail"
        and "no AWS credentials" in rows["storage put/get/delete"]["value"]
    )
    assert rows["shared memory"]["status"] == "pass" and rows["torch"]["status"] == "pass"
    gpuctl("down", "--yes", check=True)


def test_offers_for_the_seed_config_list_only_hosts_with_plans_ram(project, gpuctl: Gpuctl, monkeypatch):
    from tests.fakes.vast_api import FakeVast, offer

    offers = [
        offer(2001, ram_mb=128_000, price=0.9),
        offer(2002, ram_mb=256_000, price=1.2),
        offer(2003, ram_mb=128_000),
    ]
    with FakeVast(offers=offers) as fake:
        monkeypatch.setenv("VAST_API_KEY", fake.key)
        cfg = {
            "provider": {"kind": "vast", "api_url": fake.url},
            "train": {"model": "deepseek-7b", "precision": "fp16", "seq_len": 2048, "gradient_checkpointing": True},
        }
        (project / "gpuctl.yaml").write_text(json.dumps(cfg))
        listed = gpuctl("offers", "--json", check=True)
        table = gpuctl("offers", check=True, env={"COLUMNS": "200"})
    assert [o["id"] for o in json.loads(listed.stdout)] == ["2002"]
    assert "host RAM >= 168 GB (gpuctl plan; plan needs 168 GB" in listed.stderr
    assert "deepseek-7b, ZeRO-2, offload cpu, fp16, 3 GPUs per node" in listed.stderr
    assert "2002" in table.stdout and "2001" not in table.stdout and "256" in table.stdout

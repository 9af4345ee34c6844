"""Two SSH nodes (127.0.0.1 and 127.0.0.2 behind one loopback sshd), one CPU rank each, DeepSpeed's
pdsh launcher, checkpoints to S3 on moto: every node's ranks get the storage credentials (each
node uploads its own shards and marker) although their shells start from sshd with no AWS_*, and
the secret never reaches the pdsh command line, job.log, the run dirs or the state dir.

The two nodes share one filesystem here, so the run dir is one folder for both: the secrets file
must survive until every node's ranks have read it (the trainer deletes it once all ranks are up).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import Gpuctl
from tests.s3server import MotoS3
from tests.sshd import SSHD
from tests.test_storage_e2e import MARKER, ArgvWatch, cli_env, objects

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
pytest.importorskip("deepspeed")
EXTENSIONS = os.environ.get(
    "TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions")
)


def test_two_nodes_upload_with_handed_over_credentials(sshd: SSHD, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    env = cli_env(tmp_path / "aws", tmp_path / "state")
    with MotoS3(log_dir=tmp_path) as server:
        bucket = server.make_bucket()
        cfg = {
            "name": "s3two",
            "provider": {
                "kind": "ssh",
                "hosts": [sshd.host("127.0.0.1"), sshd.host("127.0.0.2")],
                "identity_file": str(sshd.client_key),
                "python": sys.executable,
                "cpu_ranks": 1,
                "workdir": str(project / "node"),
                "authorized_keys": str(sshd.authorized_keys),
                "ready_timeout": 30,
            },
            "train": {"max_steps": 4, "checkpoint_every": 2, "seq_len": 64},
            "storage": {
                "url": f"s3://{bucket}/two",
                "endpoint_url": server.endpoint,
                "region": "us-east-1",
                "profile": "gpuctl-e2e",
            },
            "env": {"TORCH_EXTENSIONS_DIR": EXTENSIONS},
        }  # the ranks' shells start from sshd
        (project / "gpuctl.yaml").write_text(yaml.safe_dump(cfg))

        gpuctl = Gpuctl(project, env)
        outputs = gpuctl.outputs  # everything gpuctl printed, for the leak check
        up = gpuctl("up")
        assert up.returncode == 0, up.stderr
        try:
            with ArgvWatch() as argv:
                train = gpuctl("train")
            assert train.returncode == 0, train.stdout[-4000:] + train.stderr[-3000:]
            run = json.loads(gpuctl("status", "--json").stdout)["run"]
            stored = objects(server, bucket, "two")
        finally:
            gpuctl("down")

    run_dir = Path(run["run_dir"])
    log = (run_dir / "job.log").read_text()
    assert "127.0.0.2: " in log and "dist_world_size=2" in log  # really two nodes through pdsh
    assert "cmd = pdsh" in log  # DeepSpeed logged its pdsh command: no secret in it (below)
    for tag in ("step2", "step4"):
        assert f"{tag}/manifest.json" in stored
        assert f"{tag}/_nodes/0.json" in stored and f"{tag}/_nodes/1.json" in stored  # both nodes uploaded

    marker = MARKER.encode()
    assert MARKER not in log and not [o for o in outputs if MARKER in o]
    assert argv.samples > 5 and argv.hits == []
    for root in (tmp_path / "state", project):  # the state dir and both nodes' run dirs
        leaks = [str(p) for p in root.rglob("*") if p.is_file() and marker in p.read_bytes()]
        assert leaks == []
    assert not (run_dir / "secrets.env").exists()
    assert json.loads((run_dir / "run.json").read_text())["storage"]["profile"] is None

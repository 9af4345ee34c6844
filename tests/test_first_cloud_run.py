"""The docs' "Your first cloud run" (docs/first-cloud-run.md), run as written: each vendor's bash block is
parsed out of the page (so the page cannot go stale; the README's cloud example is the Vast.ai block,
tests/test_docs.py) and its commands run against the fake vendor APIs (tests/fakes/) and moto's
S3: `gpuctl init --provider ... --storage s3://...`, `offers`, `up`, `train`, `ckpt pull --hf`. The run trains,
the final checkpoint lands in the bucket, and the instance is gone without `gpuctl down` (which then
answers twice without error), its run's secrets.env removed, the API key in no output, state or node file
(and, for Vast, in no request path).

Where the block cannot run here as it stands, the test does the same thing and says so: `export KEY=...` is
the fake's key in the environment; `aws s3 mb` gets moto's --endpoint-url; and after `init` the written
gpuctl.yaml is edited for this machine only (`edit_for_this_machine`). Plus what `train` says once a run
on rented nodes ends: gone (checked with the vendor, the cluster forgotten) or still billing.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess

import pytest
import yaml

from provision.core import state
from provision.core.config import load_config
from provision.flows import cluster
from provision.providers.base import UpOptions
from tests.fakes.harness import (
    assert_secret_absent,
    node_fields,
    saved_run,
    serve_runpod,
    serve_vast,
    text_once_it_says,
    write_config,
)
from tests.helpers import REPO
from tests.s3server import MotoS3, venv_bin

BUCKET = "my-gpuctl-bucket"
KEY_VARS = {"Vast.ai": "VAST_API_KEY", "RunPod": "RUNPOD_API_KEY", "AWS": "AWS_PROFILE"}


def guide_commands(vendor: str) -> list[str]:
    """The bash block of the vendor's part of docs/first-cloud-run.md, one command a line."""
    text = (REPO / "docs" / "first-cloud-run.md").read_text()
    part = text.split(f"\n## {vendor}\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", part, re.S)
    assert block, f"docs/first-cloud-run.md: no bash block under ## {vendor}"
    return [line.strip() for line in block[1].splitlines() if line.strip()]


def edit_for_this_machine(project, api_url: str, s3_endpoint: str) -> None:
    """Test-only edit of the yaml `init` wrote (gpuctl has no override for these; an env override would be
    a knob only tests use): the stand-in "instance" is this machine's loopback sshd with CPU ranks, where
    DeepSeek-7B in fp16 cannot train, so the tiny model in fp32 for 2 steps on 3 CPU ranks (the batch stays
    1 x 4 x 3 = 12); the vendor API and the S3 endpoint are the fakes'. No budget cap: its guard would
    outlive the fake instance on this machine (a real node goes with its instance)."""
    path = project / "gpuctl.yaml"
    raw = yaml.safe_load(path.read_text())
    raw["provider"].update(api_url=api_url, max_hours=None, max_cost=None, **node_fields(project))
    raw["train"].update(
        model="tiny", precision="fp32", seq_len=64, gradient_checkpointing=False, max_steps=2, log_every=1
    )
    raw["storage"].update(endpoint_url=s3_endpoint, region="us-east-1")
    raw["env"] = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", "")}  # launch.sh has no test env
    path.write_text(yaml.safe_dump(raw, sort_keys=False))


def setup_lines(commands: list[str], vendor: str, s3: MotoS3) -> list[str]:
    """Run the block's lines before `gpuctl init` (the key, the bucket); return the gpuctl commands."""
    key, bucket, *rest = commands
    assert key.startswith(f"export {KEY_VARS[vendor]}="), key  # the fixture put the fake's key there
    assert shlex.split(bucket) == ["aws", "s3", "mb", f"s3://{BUCKET}"], bucket
    made = subprocess.run(
        [venv_bin("aws"), "--endpoint-url", s3.endpoint, *shlex.split(bucket)[1:]],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    assert all(line.startswith("gpuctl ") for line in rest), rest
    return rest


@pytest.fixture
def s3(tmp_path_factory, s3_env):
    with MotoS3(log_dir=tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture
def vendor_api(request, sshd, monkeypatch):
    serve = serve_vast if request.param == "Vast.ai" else serve_runpod
    yield from serve(sshd, monkeypatch)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("vendor_api", ["Vast.ai", "RunPod"], indirect=True)
def test_the_guide_block_trains_stores_the_checkpoint_and_the_instance_is_gone(
    request, project, gpuctl, vendor_api, s3, state_dir
):
    vendor = request.node.callspec.params["vendor_api"]
    fake = vendor_api
    init, offers, up, train, pull = setup_lines(guide_commands(vendor), vendor, s3)
    assert (
        init == f"gpuctl init --provider {'vast' if vendor == 'Vast.ai' else 'runpod'} --storage s3://{BUCKET}/gpuctl"
    )
    said = gpuctl(*shlex.split(init)[1:])
    assert said.returncode == 0, said.stderr
    edit_for_this_machine(project, fake.url, s3.endpoint)
    listed = gpuctl(*shlex.split(offers)[1:])
    assert listed.returncode == 0 and "host upload >=" in listed.stderr, listed.stderr
    rented = gpuctl(*shlex.split(up)[1:], input="y\n")  # `up` asks before renting
    assert rented.returncode == 0, rented.stderr[-3000:]
    assert "teardown after-train: the" in rented.stderr
    trained = gpuctl(*shlex.split(train)[1:], timeout=600)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    assert "step 2/2" in trained.stdout and "node: gone;" in trained.stderr, trained.stderr[-2000:]
    assert "teardown after-train: the" in trained.stderr  # `train` says it too
    # the node deleted itself: no `gpuctl down` ran, the vendor lists nothing, gpuctl forgot the cluster
    if vendor == "Vast.ai":
        assert not fake.instances and fake.deleted == [7000001]
    else:
        assert not fake.pods and fake.terminated == ["fakepod000001"]
    assert not list(state_dir.glob("clusters/*.json"))
    ended = [c for c in fake.calls if c.method == "DELETE" or "podTerminate" in str(c.body)]
    assert ended and all(c.headers["user-agent"].startswith("Python-urllib") for c in ended)  # the node's calls
    run_dir = next((project / "node" / "runs").iterdir())
    text_once_it_says(run_dir / "job.log", "self-teardown accepted")
    assert not (run_dir / "secrets.env").exists()
    keys = {o["Key"] for o in s3.client().list_objects_v2(Bucket=BUCKET, Prefix="gpuctl/").get("Contents", [])}
    assert {"gpuctl/latest", "gpuctl/step2/manifest.json"} <= keys, keys
    pulled = gpuctl(*shlex.split(pull)[1:], timeout=600)
    assert pulled.returncode == 0, pulled.stderr[-3000:]
    assert (project / "deepseek-7b-hf" / "config.json").is_file()
    downs = [gpuctl("down", "--yes") for _ in range(2)]  # after the node went by itself: nothing to do, twice
    assert [d.returncode for d in downs] == [0, 0], downs[-1].stderr
    outputs = [t for r in (said, listed, rented, trained, pulled, *downs) for t in (r.stdout, r.stderr)]
    assert_secret_absent(fake.key, *outputs, dirs=(state_dir, project))  # the node's workdir is project/node
    if vendor == "Vast.ai":
        assert all(fake.key not in p for p in fake.raw_paths)  # never in a URL


def test_the_aws_block_starts_as_written(project, gpuctl, s3_env, monkeypatch, tmp_path):
    """AWS's block up to `offers` against moto's EC2 (its up/train path: tests/test_cloud_aws.py)."""
    from moto.server import ThreadedMotoServer

    from tests.helpers import free_port

    commands = guide_commands("AWS")
    assert commands[0].startswith("export AWS_PROFILE=") and commands[1] == f"aws s3 mb s3://{BUCKET}"
    init, offers, up, train, pull = commands[2:]
    assert (up, train, pull) == ("gpuctl up", "gpuctl train", "gpuctl ckpt pull --hf ./deepseek-7b-hf")
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        said = gpuctl(*shlex.split(init)[1:])
        assert said.returncode == 0, said.stderr
        raw = yaml.safe_load((project / "gpuctl.yaml").read_text())
        raw["provider"]["api_url"] = f"http://127.0.0.1:{port}"  # moto's EC2 in place of AWS's
        (project / "gpuctl.yaml").write_text(yaml.safe_dump(raw))
        listed = gpuctl(*shlex.split(offers)[1:], "--json")
    finally:
        server.stop()
    assert listed.returncode == 0, listed.stderr
    assert [o["id"] for o in json.loads(listed.stdout)] == ["g5.12xlarge"]
    assert "host RAM >= 172 GB (gpuctl plan" in listed.stderr  # DeepSeek-7B on its 4 GPUs


# --- what `train` says once the run on rented nodes ended ----------------------------------------------


@pytest.fixture
def vast(sshd, monkeypatch):
    yield from serve_vast(sshd, monkeypatch)


def up_with(project, fake, teardown: str):
    write_config(
        project, {"kind": "vast", "api_url": fake.url, **node_fields(project)}, name="first", teardown=teardown
    )
    cfg = load_config(project / "gpuctl.yaml")
    record = cluster.up(cfg, UpOptions(assume_yes=True, say=lambda _line: None, doctor=False))
    return cfg, record, saved_run(record.name, "r1")


def test_teardown_never_says_the_node_still_bills(project, vast):
    cfg, record, run = up_with(project, vast, "never")
    said: list[str] = []
    cluster.after_run(cfg, run, said.append)
    assert said == ["node: the vast cluster first is still up and billing $1.050/h: `gpuctl down` deletes it"]
    assert state.find_cluster("first") is not None and vast.instances


def test_nodes_that_deleted_themselves_are_checked_with_the_vendor_and_forgotten(project, vast, state_dir):
    cfg, record, run = up_with(project, vast, "after-train")
    said: list[str] = []
    vast.instances.clear()  # the node ran its self-teardown at the end of the run
    cluster.after_run(cfg, run, said.append)
    assert said[-1].startswith("node: gone; vast instance(s) 7000001 deleted themselves after the run")
    assert state.find_cluster("first") is None and not (state_dir / "keys" / "first").exists()
    assert not any(method == "DELETE" for method, _ in vast.requests)  # gpuctl deleted nothing itself


def test_a_node_the_vendor_still_lists_after_the_run_is_named_with_gpuctl_down(project, vast, monkeypatch):
    cfg, record, run = up_with(project, vast, "after-train")
    monkeypatch.setattr(cluster, "SELF_TEARDOWN_WAIT_S", 1.0)
    said: list[str] = []
    cluster.after_run(cfg, run, said.append)
    assert "still lists instance(s) 7000001" in said[-1] and "`gpuctl down` terminates it" in said[-1]
    assert state.find_cluster("first") is not None  # kept for `gpuctl down`

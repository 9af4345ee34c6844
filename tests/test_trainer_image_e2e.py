"""`gpuctl up && gpuctl train` with the real trainer image (cpu flavour) as the node.

- vast (runtime image): the fake Vast API boots a container of the image its create call names,
  the way Vast's SSH runtypes do: the image's entrypoint replaced by Vast's own boot (the keys
  the API attached, the template's onstart, `sshd -D`). gpuctl reaches it over SSH as it would a
  rented instance, trains on CPU ranks (provider.cpu_ranks_fallback), and the checkpoints land
  in the moto S3 server.
- runpod (runtime image): the fake RunPod API boots the image with its own entrypoint and the
  env the deploy call sent; the entrypoint starts sshd with the key from PUBLIC_KEY.
- ssh + runtime docker: an SSH host whose docker is the image engine; the launcher runs inside
  `docker run` of the image.
All containers share the host's network (the engine has no bridge): each instance's sshd gets
its own port on 127.0.0.1 where a vendor would map 22/tcp.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from provision.providers import cloud
from tests.fakes.base import SshTarget
from tests.fakes.runpod_api import FakeRunPod
from tests.fakes.vast_api import FakeVast
from tests.helpers import Gpuctl, free_port
from tests.sshd import SSHD

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]  # the first test may pay for the image build
VAST_BOOT = (  # what Vast runs in place of the entrypoint for ssh_direct / ssh_proxy
    'mkdir -p /run/sshd && ssh-keygen -A >/dev/null && { [ -z "$1" ] || bash -c "$1"; } && exec /usr/sbin/sshd -D -e -p "$2" -o ListenAddress=127.0.0.1'
)


class Booter:
    """Starts and removes the instances' containers in the image engine."""

    def __init__(self, image, keys_dir: Path):
        self.image, self.keys_dir = image, keys_dir
        self.port = free_port()
        self.containers: dict[str, str] = {}  # instance id -> container id

    def target(self) -> SshTarget:
        return SshTarget(address="127.0.0.1", port=self.port, authorized_keys=self.keys_dir / "authorized_keys")

    def boot(self, instance: str, *argv: str) -> None:
        # --shm-size: a rented container's /dev/shm is sized for training, not docker's 64 MB default
        # (the quick checks of `up` fail a node below 1 GB, as NCCL and the data loader would).
        out = self.image.engine.docker("run", "-d", "--network", "host", "--shm-size", "1g", *argv)
        self.containers[instance] = out.stdout.decode().strip()

    def remove(self, instance: str) -> None:
        if cid := self.containers.pop(instance, None):
            self.image.engine.docker("rm", "-f", cid, check=False)

    def running(self) -> list[str]:
        return self.image.engine.docker("ps", "-q").stdout.decode().split()


class BootingVast(FakeVast):
    booter: Booter

    def _create(self, offer_id: int, body: dict) -> tuple[int, dict]:
        status, answer = super()._create(offer_id, body)
        env = [arg for name, value in (body.get("env") or {}).items() for arg in ("-e", f"{name}={value}")]
        mount = ["-v", f"{self.booter.keys_dir}:/root/.ssh"]  # where the API's POST .../ssh/ puts keys
        argv = [*mount, *env, "--entrypoint", "bash", body["image"], "-c", VAST_BOOT, "vast-boot"]
        self.booter.boot(str(answer["new_contract"]), *argv, body.get("onstart") or "", str(self.booter.port))
        return status, answer

    def handle(self, method: str, path: str, body, query: dict) -> tuple[int, dict]:
        status, answer = super().handle(method, path, body, query)
        if method == "DELETE" and status == 200:
            self.booter.remove(path.rstrip("/").rsplit("/", 1)[-1])
        return status, answer


class BootingRunPod(FakeRunPod):
    booter: Booter

    def _deploy(self, arg: dict, spot: bool) -> dict:
        pod = super()._deploy(arg, spot)
        env = [a for e in arg.get("env") or [] for a in ("-e", f"{e['key']}={e['value']}")]
        # RunPod maps the container's 22/tcp to a public port; on the host network sshd takes the port itself
        port = ["-e", f"GPUCTL_SSHD_PORT={self.booter.port}", "-e", "GPUCTL_SSHD_LISTEN=127.0.0.1"]
        self.booter.boot(pod["id"], *env, *port, arg["imageName"])
        return pod

    def podTerminate(self, info, input):
        answer = super().podTerminate(info, input)
        self.booter.remove(input["podId"])
        return answer


@pytest.fixture
def booter(trainer_image, tmp_path, monkeypatch):
    keys = tmp_path / "instance-ssh"
    keys.mkdir(mode=0o700)
    monkeypatch.setattr(cloud, "POLL_S", 0.2)
    found = Booter(trainer_image, keys)
    yield found
    for instance in list(found.containers):
        found.remove(instance)


def write_config(project: Path, provider: dict, *, name: str, bucket: str, endpoint: str, **extra) -> None:
    cfg = {
        "name": name,
        "provider": provider,
        "train": {"max_steps": 4, "checkpoint_every": 2, "seq_len": 64, "log_every": 1},
        "storage": {"url": f"s3://{bucket}/runs/{name}", "endpoint_url": endpoint, "region": "us-east-1"},
        "env": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        **extra,
    }
    (project / "gpuctl.yaml").write_text(yaml.safe_dump(cfg))


def stored(server, bucket: str, prefix: str) -> list[str]:
    pages = server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    return sorted(obj["Key"][len(prefix) + 1 :] for page in pages for obj in page.get("Contents", ()))


def assert_trained(gpuctl: Gpuctl, server, bucket: str, name: str) -> dict:
    train = gpuctl("train", timeout=900)
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    assert "step 4/4" in train.stdout
    run = json.loads(gpuctl("status", "--json").stdout)["run"]
    assert run["state"] == "succeeded" and run["steps"] == 4 and run["world_size"] == 2
    keys = stored(server, bucket, f"runs/{name}")
    assert {"latest", "step2/manifest.json", "step4/manifest.json"} <= set(keys), keys
    assert any(k.startswith("step4/") and k.endswith("model_states.pt") for k in keys), keys
    return run


def test_vast_boots_the_image_and_gpuctl_trains_on_it_over_ssh(
    project, gpuctl, trainer_image, booter, s3_server, fresh_bucket, monkeypatch
):
    with BootingVast(ssh=booter.target()) as fake:
        fake.booter = booter
        monkeypatch.setenv("VAST_API_KEY", fake.key)
        provider = {"kind": "vast", "api_url": fake.url, "image": trainer_image.name, "cpu_ranks_fallback": 2}
        write_config(
            project,
            {**provider, "ready_timeout": 120},
            name="img-vast",
            bucket=fresh_bucket,
            endpoint=s3_server.endpoint,
            teardown="never",  # the node is asked about after the run
        )
        up = gpuctl("up", "--yes")
        assert up.returncode == 0, up.stderr
        assert fake.created_bodies[0]["image"] == trainer_image.name and len(booter.running()) == 1
        where = gpuctl("ssh", "command -v python3; echo $DS_ACCELERATOR; pwd")
        assert where.stdout.split() == ["/opt/venv/bin/python3", "cpu", "/root"], where.stdout + where.stderr
        run = assert_trained(gpuctl, s3_server, fresh_bucket, "img-vast")
        assert run["run_dir"].startswith("/root/gpuctl/runs/")  # inside the container, not on this machine
        down = gpuctl("down", "--yes")
        assert down.returncode == 0, down.stderr
    assert fake.deleted == [7000001] and booter.running() == []


def test_runpod_boots_the_image_whose_entrypoint_starts_sshd_with_public_key(
    project, gpuctl, trainer_image, booter, monkeypatch
):
    with BootingRunPod(ssh=booter.target()) as fake:
        fake.booter = booter
        monkeypatch.setenv("RUNPOD_API_KEY", fake.key)
        provider = {"kind": "runpod", "api_url": fake.url, "image": trainer_image.name, "cpu_ranks_fallback": 2}
        (project / "gpuctl.yaml").write_text(
            yaml.safe_dump(
                {
                    "name": "img-rp",
                    "provider": {**provider, "ready_timeout": 120},
                    "storage": {"node_local": True},  # nothing is trained: the default path is fine
                }
            )
        )
        up = gpuctl("up", "--yes")
        assert up.returncode == 0, up.stderr
        probe = "python -c 'import deepspeed, sys; print(sys.executable)'; echo $GPUCTL_CLUSTER $DS_ACCELERATOR"
        where = gpuctl("ssh", probe)
        assert where.stdout.split() == ["/opt/venv/bin/python", "img-rp", "cpu"], where.stdout + where.stderr
        down = gpuctl("down", "--yes")
        assert down.returncode == 0, down.stderr
    assert booter.running() == []


@pytest.fixture
def docker_host_sshd(tmp_path_factory, trainer_image):
    """A loopback sshd whose sessions use the image engine as their docker."""
    server = SSHD(tmp_path_factory.mktemp("img-sshd"), session_env={"DOCKER_HOST": trainer_image.engine.host})
    yield server.start()
    server.stop()


def test_runtime_docker_on_an_ssh_host_runs_the_launcher_in_the_image(
    project, gpuctl, trainer_image, docker_host_sshd, s3_server, fresh_bucket, tmp_path, monkeypatch
):
    server = docker_host_sshd
    provider = {
        "kind": "ssh",
        "hosts": [server.host()],
        "identity_file": str(server.client_key),
        "runtime": "docker",
        "image": trainer_image.name,
        "workdir": str(tmp_path / "node"),
        "cpu_ranks": 2,
    }
    docker = {"ship": "load", "shm_size": "1g", "ulimits": ["stack=67108864"]}  # memlock=-1 is refused here
    write_config(project, provider, name="img-docker", bucket=fresh_bucket, endpoint=s3_server.endpoint, docker=docker)
    monkeypatch.setenv("DOCKER_HOST", trainer_image.engine.host)  # the laptop's docker: the same engine
    up = gpuctl("up", "--yes")
    assert up.returncode == 0, up.stderr
    assert "skipping the transfer" in up.stderr  # the node's engine has this very image
    run = assert_trained(gpuctl, s3_server, fresh_bucket, "img-docker")
    launch = (Path(run["run_dir"]) / "launch.sh").read_text()
    assert "docker run --rm --init" in launch and trainer_image.name in launch
    assert trainer_image.engine.docker("ps", "-aq").stdout.strip() == b""  # --rm: no container left
    down = gpuctl("down", "--yes")
    assert down.returncode == 0, down.stderr

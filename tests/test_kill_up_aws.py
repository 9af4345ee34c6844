"""AWS (moto's EC2 server on loopback): a killed `up` leaves nothing billing (issue 34, item 2),
and a failed `up` or `run` after the create terminates what it created (item 5).

gpuctl reaches moto through a TcpProxy, so a test can SIGKILL gpuctl the moment moto's
RunInstances answer goes out (the instance exists; gpuctl never reads its id), or while gpuctl
waits for SSH (the instance's SSH address, $GPUCTL_AWS_TEST_SSH, is a second proxy to the
loopback sshd). The same code path as Vast.ai and RunPod (providers/cloud.py) records the intent
before run_instances; `gpuctl down` finds the instance by its Name tag, `gpuctl sweep` by the
gpuctl-cluster tag.
"""

from __future__ import annotations

import signal
import socket
import urllib.request

import boto3
import pytest
import yaml

from provision.providers import aws, cloud
from tests.fakes.harness import Killer, node_fields, ssh_target, write_config
from tests.fakes.tcp_proxy import TcpProxy

pytestmark = pytest.mark.timeout(240)
AMI = "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) 20260101"
UNPULLABLE = "127.0.0.1:9/gpuctl/no-such-image:0"  # a registry on a closed port: every pull fails


@pytest.fixture(scope="module")
def moto_port():
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield port
    server.stop()


@pytest.fixture
def ec2(moto_port, monkeypatch, sshd, project, tmp_path):
    """moto reset, behind an API proxy; the instances' SSH behind another; gpuctl.yaml for aws-k."""
    url = f"http://127.0.0.1:{moto_port}"
    urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", method="POST"), timeout=30)
    with TcpProxy(("127.0.0.1", moto_port)) as api, TcpProxy(("127.0.0.1", sshd.port)) as ssh:
        for key, value in {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            aws.TEST_SSH_ENV: f"127.0.0.1:{ssh.port}",
        }.items():
            monkeypatch.setenv(key, value)
        for name in ("AWS_PROFILE", "VAST_API_KEY", "RUNPOD_API_KEY"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setattr(cloud, "POLL_S", 0.2)
        client = boto3.client("ec2", region_name="us-east-1", endpoint_url=url)
        client.register_image(Name=AMI, RootDeviceName="/dev/sda1", Architecture="x86_64")
        prov = {
            "kind": "aws",
            "api_url": f"http://127.0.0.1:{api.port}",
            "region": "us-east-1",
            "ami_owner": "self",
            "ssh_cidr": "127.0.0.1/32",
            "ssh_user": sshd.user,
            "runtime": "none",
            **node_fields(tmp_path),
        }
        write_config(project, prov, name="aws-k")
        yield client, api, ssh


def live(client) -> list[str]:
    found = client.describe_instances(Filters=[{"Name": "instance-state-name", "Values": aws.ACTIVE_STATES}])
    return [i["InstanceId"] for r in found["Reservations"] for i in r["Instances"]]


def groups(client) -> list[str]:
    found = client.describe_security_groups(Filters=[{"Name": "group-name", "Values": ["gpuctl-aws-k"]}])
    return [g["GroupName"] for g in found["SecurityGroups"]]


POINTS = {
    "run_instances answered, answer lost": lambda api, ssh, k: setattr(
        api, "on_chunk", lambda _c, d, data: k.fire() if d == "down" and b"<RunInstancesResponse" in data else None
    ),
    "waiting for SSH": lambda api, ssh, k: setattr(ssh, "on_chunk", lambda *_: k.fire()),
}
CASES = [(point, finish) for point in POINTS for finish in ("down", "sweep")]


@pytest.mark.parametrize("point,finish", CASES, ids=[f"{p.split(',')[0].replace(' ', '_')}-{f}" for p, f in CASES])
def test_a_killed_up_on_aws_leaves_nothing_billing(ec2, project, gpuctl, state_dir, point, finish):
    client, api, ssh = ec2
    killer = Killer(signal.SIGKILL)
    POINTS[point](api, ssh, killer)
    rc, err = killer.run(project, "up", "--yes")
    api.on_chunk = ssh.on_chunk = None
    assert rc == -signal.SIGKILL and len(live(client)) == 1, err[-3000:]
    done = gpuctl(finish, "--yes")
    assert done.returncode == 0, done.stdout + done.stderr
    assert live(client) == [] and groups(client) == []  # the security group goes with the instance
    assert not list(state_dir.glob("clusters/*.json"))


def unpullable_image(project, sshd) -> None:
    """runtime docker with an image no registry serves: `up` fails after the instance booted."""
    cfg = yaml.safe_load((project / "gpuctl.yaml").read_text())
    cfg["provider"].update(runtime="docker", image=UNPULLABLE)
    cfg["docker"] = {"ship": "pull"}
    (project / "gpuctl.yaml").write_text(yaml.safe_dump(cfg))
    from provision.transport.ssh import mesh

    ssh_target(sshd).add_key(mesh.cluster_keypair("aws-k")[1])  # what EC2 + cloud-init do with the key pair


@pytest.mark.parametrize("command", ["up", "run"])
def test_a_failure_after_create_terminates_what_up_created(ec2, project, gpuctl, state_dir, sshd, command):
    """The image cannot be pulled on the node (exit 4): `up` and `run` terminate the instance they
    created instead of leaving it running with the error."""
    client, _api, _ssh = ec2
    unpullable_image(project, sshd)
    result = gpuctl(command, "--yes")
    assert result.returncode == 4, result.stdout[-2000:] + result.stderr[-3000:]
    assert f"docker pull {UNPULLABLE}" in result.stderr and "docker pull failed" in result.stderr
    assert "up failed: terminating the 1 instance(s) this attempt created" in result.stderr
    assert "Traceback" not in result.stderr
    assert live(client) == [] and groups(client) == []
    assert not list(state_dir.glob("clusters/*.json"))

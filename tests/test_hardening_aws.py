"""AWS with two nodes against moto's EC2 server: the security group lets the cluster's members reach
each other (pdsh, NCCL), the nodes talk over their private addresses, the first node's
self-teardown shuts the other node down through the cluster's own ssh config and key, and a
capped cluster gets the budget guard plus `shutdown -h +N` on every node (which must succeed), and
a rebooted node starts its guard again from the per-boot script of its user data.

moto's instances run nothing: SSH goes to the loopback sshd ($GPUCTL_AWS_TEST_SSH) and `shutdown`
is a stand-in script ($GPUCTL_AWS_TEST_SHUTDOWN) that logs where it ran, never the real one.
"""

from __future__ import annotations

import base64
import os
import re
import socket
import subprocess
import urllib.request
from pathlib import Path

import boto3
import pytest
import yaml

from provision.core import state
from provision.core.config import load_config
from provision.core.errors import RemoteError
from provision.flows import cluster
from provision.providers import aws, cloud
from provision.providers.base import UpOptions
from provision.transport.ssh import mesh
from tests.fakes.guards import kill_guards, restart_and_check
from tests.fakes.harness import node_fields, ssh_target, write_config

pytestmark = pytest.mark.timeout(240)
AMI = "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) 20260101"


@pytest.fixture(scope="module")
def moto_url():
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def ec2(moto_url, monkeypatch, sshd, tmp_path):
    urllib.request.urlopen(urllib.request.Request(f"{moto_url}/moto-api/reset", method="POST"), timeout=30)
    shutdown_log = tmp_path / "shutdown.log"
    fake_shutdown = tmp_path / "fake-shutdown"
    fake_shutdown.write_text(
        "#!/bin/bash\n"
        f'if [ -n "${{SSH_CONNECTION:-}}" ]; then where="ssh:${{SSH_CONNECTION#* * }}"; else where=local; fi\n'
        f'echo "$where $*" >> {shutdown_log}\n'
    )
    fake_shutdown.chmod(0o755)
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        aws.TEST_SSH_ENV: f"127.0.0.1:{sshd.port}",
        aws.TEST_SHUTDOWN_ENV: str(fake_shutdown),
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setattr(cloud, "POLL_S", 0.2)
    client = boto3.client("ec2", region_name="us-east-1", endpoint_url=moto_url)
    client.register_image(Name=AMI, RootDeviceName="/dev/sda1", Architecture="x86_64")
    client.url, client.shutdown_log = moto_url, shutdown_log
    yield client
    kill_guards(tmp_path)  # a capped cluster's guards: ours to end


def two_nodes(project: Path, ec2, tmp_path: Path, sshd, name: str, **extra) -> None:
    prov = {
        "kind": "aws",
        "api_url": ec2.url,
        "region": "us-east-1",
        "ami_owner": "self",
        "ssh_cidr": "127.0.0.1/32",
        "ssh_user": sshd.user,
        "runtime": "none",
        "nodes": 2,
        **node_fields(tmp_path, ranks=1),
        **extra,
    }
    write_config(project, prov, name=name)
    ssh_target(sshd).add_key(mesh.cluster_keypair(name)[1])  # what EC2 does with the imported key pair


def forget_mesh_key(name: str, public: str | None = None) -> None:
    """mesh.setup also edits the test machine's own ~/.ssh/authorized_keys (the "nodes" are this host).
    public: the cluster's key, read before a failed `up` removed its folder."""
    public = public or (mesh.key_dir(name) / "id_ed25519.pub").read_text().strip()
    subprocess.run(["bash", "-c", mesh.EDIT_KEY, "x", "~/.ssh/authorized_keys", public, ""], check=False)


def test_two_nodes_reach_each_other_and_the_first_ends_both(project, ec2, tmp_path, sshd, state_dir):
    two_nodes(project, ec2, tmp_path, sshd, "aws-two")
    said: list[str] = []
    record = cluster.up(load_config(project / "gpuctl.yaml"), UpOptions(assume_yes=True, say=said.append))
    try:
        assert len(record.nodes) == 2 and any("node-to-node SSH ready" in s for s in said)
        ids = [n.instance_id for n in record.nodes]
        found = ec2.describe_instances(InstanceIds=ids)["Reservations"]
        group_id = found[0]["Instances"][0]["SecurityGroups"][0]["GroupId"]
        rules = ec2.describe_security_groups(GroupIds=[group_id])["SecurityGroups"][0]["IpPermissions"]
        members = [r for r in rules if r["IpProtocol"] == "-1"]
        assert [[p["GroupId"] for p in r["UserIdGroupPairs"]] for r in members] == [[group_id]]
        ssh_rule = [r for r in rules if r.get("FromPort") == 22]
        assert [[x["CidrIp"] for x in r["IpRanges"]] for r in ssh_rule] == [["127.0.0.1/32"]]
        assert all(n.private_address for n in record.nodes)  # node to node: inside the VPC

        # The first node's self-teardown, run there as the guard or launch.sh would: the other
        # node goes first, through the cluster's ssh config and key, then the first itself.
        teardown = aws.BACKEND.self_teardown(record)
        config = mesh.node_ssh_config(record.nodes[0].workdir)
        assert config in " ".join(teardown.argv) and teardown.env == {}  # no AWS key on the node
        env = {k: v for k, v in os.environ.items() if not k.startswith("SSH_")}
        done = subprocess.run(teardown.argv, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        log = ec2.shutdown_log.read_text().splitlines()
        assert log == [f"ssh:127.0.0.1 {sshd.port} -h now", "local -h now"], log
    finally:
        forget_mesh_key("aws-two")
        cluster.down("aws-two", say=lambda _: None)
    states = ec2.describe_instances(InstanceIds=ids)["Reservations"]
    assert {i["State"]["Name"] for r in states for i in r["Instances"]} == {"terminated"}


def test_a_capped_cluster_gets_the_guard_and_a_shutdown_backstop_on_every_node(project, ec2, tmp_path, sshd, state_dir):
    two_nodes(project, ec2, tmp_path, sshd, "aws-cap", max_hours=1)
    said: list[str] = []
    record = cluster.up(load_config(project / "gpuctl.yaml"), UpOptions(assume_yes=True, say=said.append))
    try:
        backstops = ec2.shutdown_log.read_text().splitlines()
        assert len(backstops) == 2 and all(re.fullmatch(r"ssh:127\.0\.0\.1 \d+ -h \+6[23]", b) for b in backstops)
        assert any("budget guard started on node0" in s for s in said)
        guard_log = Path(record.nodes[0].workdir) / "guard" / "guard.log"
        assert "budget guard up: cap 1.00 h" in guard_log.read_text()
    finally:
        forget_mesh_key("aws-cap")
        cluster.down("aws-cap", say=lambda _: None)


def test_a_shutdown_backstop_that_cannot_be_scheduled_fails_up(project, ec2, tmp_path, sshd, state_dir):
    """`sudo -n shutdown -h +N` refused (no passwordless sudo): an error with the fix, not a warning;
    `up` then terminates what it created."""
    refuse = tmp_path / "refusing-shutdown"
    refuse.write_text('#!/bin/bash\necho "sudo: a password is required" >&2\nexit 1\n')
    refuse.chmod(0o755)
    os.environ[aws.TEST_SHUTDOWN_ENV] = str(refuse)  # the fixture's monkeypatch restores it
    two_nodes(project, ec2, tmp_path, sshd, "aws-nobackstop", max_hours=1)
    public = mesh.cluster_keypair("aws-nobackstop")[1].strip()
    try:
        with pytest.raises(RemoteError) as err:
            cluster.up(load_config(project / "gpuctl.yaml"), UpOptions(assume_yes=True, say=lambda _: None))
    finally:
        forget_mesh_key("aws-nobackstop", public)
    line = err.value.one_line()
    assert "node0: could not schedule" in line and "-h +6" in line and "sudo: a password is required" in line
    assert "fix: let " in line and "passwordless sudo for shutdown" in line
    assert state.find_cluster("aws-nobackstop") is None
    found = ec2.describe_instances(Filters=[{"Name": "tag:gpuctl-cluster", "Values": ["aws-nobackstop"]}])
    assert {i["State"]["Name"] for r in found["Reservations"] for i in r["Instances"]} == {"terminated"}


def test_a_rebooted_node_starts_its_guard_again_from_the_per_boot_user_data(project, ec2, tmp_path, sshd, state_dir):
    two_nodes(project, ec2, tmp_path, sshd, "aws-reboot", max_hours=1)
    record = cluster.up(load_config(project / "gpuctl.yaml"), UpOptions(assume_yes=True, say=lambda _: None))
    try:
        raw = ec2.describe_instance_attribute(InstanceId=record.nodes[0].instance_id, Attribute="userData")
        doc = yaml.safe_load(base64.b64decode(raw["UserData"]["Value"]))
        (per_boot,) = [f for f in doc["write_files"] if f["path"] == aws.PER_BOOT]
        assert per_boot["permissions"] == "0755" and "ssh_authorized_keys" not in doc  # no key_name: the pair
        # cloud-init runs the per-boot script as root at every boot; the node's guards start again
        env = {"PATH": os.environ["PATH"], "HOME": "/root"}
        restart_and_check(Path(record.nodes[0].workdir) / "guard", ["bash", "-c", per_boot["content"]], env)
    finally:
        forget_mesh_key("aws-reboot")
        cluster.down("aws-reboot", say=lambda _: None)

"""Provider aws against moto's EC2 server on loopback (provider.api_url = its endpoint).

moto's instances run nothing, so SSH goes to the loopback test sshd through the test-only
$GPUCTL_AWS_TEST_SSH=host:port override; everything else is the real provider code on EC2's API.
"""

from __future__ import annotations

import socket
import urllib.request

import boto3
import pytest

from provision.core.config import load_config
from provision.core.errors import AuthError, ConfigError, NoOfferError, ProviderError
from provision.core.provider_config import AWSProvider
from provision.core.state import ClusterRecord, NodeRecord
from provision.providers import aws, cloud
from provision.providers.base import UpOptions
from tests.fakes.harness import node_fields, write_config

pytestmark = pytest.mark.timeout(240)
AMI_NAME = "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) 20260101"


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
def ec2(moto_url, monkeypatch, sshd):
    urllib.request.urlopen(urllib.request.Request(f"{moto_url}/moto-api/reset", method="POST"), timeout=30)
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        aws.TEST_SSH_ENV: f"127.0.0.1:{sshd.port}",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setattr(cloud, "POLL_S", 0.2)
    client = boto3.client("ec2", region_name="us-east-1", endpoint_url=moto_url)
    client.url = moto_url
    return client


def register_amis(client) -> str:
    """Two images by the configured name: the newer one must be picked."""
    old = client.register_image(
        Name=AMI_NAME.replace("20260101", "20250101"), RootDeviceName="/dev/sda1", Architecture="x86_64"
    )["ImageId"]
    new = client.register_image(Name=AMI_NAME, RootDeviceName="/dev/sda1", Architecture="x86_64")["ImageId"]
    assert old != new
    return new


def instance_key(sshd, cluster: str) -> None:
    """What EC2 + cloud-init do with the imported key pair: put it in the login's authorized_keys."""
    from provision.transport.ssh import mesh
    from tests.fakes.harness import ssh_target

    ssh_target(sshd).add_key(mesh.cluster_keypair(cluster)[1])


def provider(ec2, tmp_path, sshd, **extra) -> dict:
    return {
        "kind": "aws",
        "api_url": ec2.url,
        "region": "us-east-1",
        "ami_owner": "self",
        "ssh_cidr": "127.0.0.1/32",
        "ssh_user": sshd.user,
        "runtime": "none",  # no docker here
        **node_fields(tmp_path),
        **extra,
    }


def test_up_creates_what_the_design_says_and_down_removes_it(project, gpuctl, ec2, tmp_path, sshd, state_dir):
    newest = register_amis(ec2)
    write_config(project, provider(ec2, tmp_path, sshd), name="aws-t")
    instance_key(sshd, "aws-t")
    cfg = load_config(project / "gpuctl.yaml")
    from provision.flows import cluster

    record = cluster.up(cfg, UpOptions(assume_yes=True, say=lambda _: None))
    node = record.nodes[0]
    assert record.price_per_hour == aws.PRICES["g5.12xlarge"] and record.region == "us-east-1"
    assert record.runtime == "none" and record.identity_file.endswith("keys/aws-t/id_ed25519")
    assert node.slots == 3 and node.accelerator == "cpu" and node.port == sshd.port  # 3: the test's fallback
    inst = ec2.describe_instances(InstanceIds=[node.instance_id])["Reservations"][0]["Instances"][0]
    assert inst["ImageId"] == newest and inst["InstanceType"] == "g5.12xlarge"
    assert inst["KeyName"] == "gpuctl-aws-t"
    tags = {t["Key"]: t["Value"] for t in inst["Tags"]}
    assert tags["gpuctl-cluster"] == "aws-t" and tags["Name"].startswith("gpuctl-aws-t-0-")
    behaviour = ec2.describe_instance_attribute(
        InstanceId=node.instance_id, Attribute="instanceInitiatedShutdownBehavior"
    )
    assert behaviour["InstanceInitiatedShutdownBehavior"]["Value"] == "terminate"
    group = ec2.describe_security_groups(GroupIds=[inst["SecurityGroups"][0]["GroupId"]])["SecurityGroups"][0]
    assert group["GroupName"] == "gpuctl-aws-t"
    tcp = [p for p in group["IpPermissions"] if p["IpProtocol"] == "tcp"]
    assert [(p["FromPort"], p["ToPort"], [r["CidrIp"] for r in p["IpRanges"]]) for p in tcp] == [
        (22, 22, ["127.0.0.1/32"])
    ]
    members = [p for p in group["IpPermissions"] if p["IpProtocol"] == "-1"]  # node to node (pdsh, NCCL)
    assert [[g["GroupId"] for g in p["UserIdGroupPairs"]] for p in members] == [[group["GroupId"]]]
    pair = ec2.describe_key_pairs(KeyNames=["gpuctl-aws-t"])["KeyPairs"][0]
    assert pair["KeyName"] == "gpuctl-aws-t"
    assert [i.id for i in aws.BACKEND.list_instances(record)] == [node.instance_id]

    for _ in range(2):
        result = gpuctl("down", "--yes")
        assert result.returncode == 0, result.stderr
    state = ec2.describe_instances(InstanceIds=[node.instance_id])["Reservations"][0]["Instances"][0]["State"]
    assert state["Name"] == "terminated"
    assert not ec2.describe_security_groups(Filters=[{"Name": "group-name", "Values": ["gpuctl-aws-t"]}])[
        "SecurityGroups"
    ]
    assert not [k for k in ec2.describe_key_pairs()["KeyPairs"] if k["KeyName"] == "gpuctl-aws-t"]


def test_offers_and_no_offer_line(project, gpuctl, ec2, tmp_path, sshd):
    write_config(project, provider(ec2, tmp_path, sshd), name="aws-t")
    shown = gpuctl("offers")
    assert shown.returncode == 0 and "g5.12xlarge" in shown.stdout and "5.672" in shown.stdout
    assert "A10G" in shown.stdout and "EC2 rents no RTX 4090)" in shown.stdout
    write_config(project, provider(ec2, tmp_path, sshd, min_ram_gb=1024), name="aws-t")
    result = gpuctl("up", "--yes")
    assert result.returncode == 5
    assert (
        "no aws offer matches (instance_type=g5.12xlarge in us-east-1, >= 4 x A10G, memory>=1024 GB; "
        "EC2 rents no RTX 4090)" in result.stderr
    )


def test_missing_ami_fails_before_anything_is_left(project, gpuctl, ec2, tmp_path, sshd, state_dir):
    write_config(project, provider(ec2, tmp_path, sshd, ami_name="no such image *"), name="aws-t")
    result = gpuctl("up", "--yes")
    assert result.returncode == 5 and "no AMI named 'no such image *'" in result.stderr
    reservations = ec2.describe_instances()["Reservations"]
    assert not [i for r in reservations for i in r["Instances"] if i["State"]["Name"] != "terminated"]
    assert not ec2.describe_security_groups(Filters=[{"Name": "group-name", "Values": ["gpuctl-aws-t"]}])[
        "SecurityGroups"
    ]
    assert not list(state_dir.glob("clusters/*.json"))


def test_self_teardown_is_shutdown_with_terminate_behaviour():
    node = NodeRecord(host="node0", address="1.2.3.4", user="ubuntu", instance_id="i-1")
    record = ClusterRecord(name="c", provider="aws", nodes=[node])
    assert aws.BACKEND.self_teardown(record).argv == ["sudo", "-n", "shutdown", "-h", "now"]
    node.user = "root"
    assert aws.BACKEND.self_teardown(record).argv == ["shutdown", "-h", "now"]
    assert aws.BACKEND.self_teardown(record).env == {}  # no key on the node


def test_aws_errors_become_one_line_without_secrets():
    from botocore.exceptions import ClientError, NoCredentialsError

    def fail(code, status=400):
        raise ClientError(
            {"Error": {"Code": code, "Message": "msg"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "RunInstances"
        )

    with pytest.raises(AuthError, match=r"AWS refused run \(AuthFailure\)"):
        with aws.aws_errors("run"):
            fail("AuthFailure", 401)
    with pytest.raises(NoOfferError, match="InsufficientInstanceCapacity"):
        with aws.aws_errors("run"):
            fail("InsufficientInstanceCapacity")
    with pytest.raises(ProviderError, match="kept failing"):
        with aws.aws_errors("run"):
            fail("RequestLimitExceeded", 503)
    with pytest.raises(AuthError, match="no AWS credentials"):
        with aws.aws_errors("run"):
            raise NoCredentialsError()


def test_price_must_be_known(ec2):
    with pytest.raises(ConfigError) as err:
        aws.BACKEND.find_offers(AWSProvider(api_url=ec2.url, instance_type="g4dn.12xlarge", gpu="T4", min_ram_gb=0))
    assert "set provider.price_per_hour" in err.value.one_line()
    offers = aws.BACKEND.find_offers(
        AWSProvider(api_url=ec2.url, instance_type="g4dn.12xlarge", gpu="T4", min_ram_gb=0, price_per_hour=3.9)
    )
    assert [(o.id, o.num_gpus, o.price_per_hour) for o in offers] == [("g4dn.12xlarge", 4, 3.9)]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_e2e_up_train_down(project, gpuctl, ec2, tmp_path, sshd, state_dir):
    register_amis(ec2)
    # torch's Adam (no CPU Adam op to load): what is checked is EC2's side of up, train and down
    prov = provider(ec2, tmp_path, sshd, **node_fields(tmp_path, ranks=2))
    write_config(project, prov, name="aws-e2e", offload_optimizer="none")
    instance_key(sshd, "aws-e2e")
    for args in (("up", "--yes"), ("train",), ("down", "--yes"), ("down", "--yes")):
        result = gpuctl(*args)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        if args == ("train",):
            assert "step 4/4" in result.stdout
    reservations = ec2.describe_instances(Filters=[{"Name": "tag:gpuctl-cluster", "Values": ["aws-e2e"]}])
    assert [i["State"]["Name"] for r in reservations["Reservations"] for i in r["Instances"]] == ["terminated"]


def test_offer_hardware_comes_from_describe_instance_types_and_says_why_a10g(ec2):
    """moto serves EC2's own instance-type data: no hand-kept GPU table in gpuctl."""
    info = ec2.describe_instance_types(InstanceTypes=["g5.12xlarge"])["InstanceTypes"][0]
    gpu = info["GpuInfo"]["Gpus"][0]
    (offer,) = aws.BACKEND.find_offers(AWSProvider(api_url=ec2.url))
    assert (offer.gpu_name, offer.num_gpus) == (gpu["Name"], gpu["Count"]) == ("A10G", 4)
    assert offer.ram_gb == info["MemoryInfo"]["SizeInMiB"] / 1024
    assert f"{gpu['MemoryInfo']['SizeInMiB'] / 1024:.1f} GiB per GPU" in offer.where
    assert "EC2 rents no RTX 4090" in aws.BACKEND.filters_text(AWSProvider())
    assert f"table of {aws.PRICES_AS_OF}" in offer.where and offer.price_per_hour == aws.PRICES["g5.12xlarge"]
    (l4,) = aws.BACKEND.find_offers(AWSProvider(api_url=ec2.url, instance_type="g6.12xlarge", gpu="L4"))
    assert (l4.gpu_name, l4.num_gpus) == ("L4", 4)
    (own,) = aws.BACKEND.find_offers(AWSProvider(api_url=ec2.url, price_per_hour=5.0))
    assert "price: provider.price_per_hour" in own.where and own.price_per_hour == 5.0

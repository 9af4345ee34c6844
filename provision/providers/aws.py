"""Provider `aws`: EC2 through boto3 (imported only when used).

- offer: the configured instance type; its GPU model, GPU count, GPU memory and host memory
  come from describe_instance_types (and describe_instance_type_offerings: offered in the
  region), priced from provider.price_per_hour or, offline fallback, the dated table below.
  EC2 rents no RTX 4090: the default g5.12xlarge is 4 x A10G (24 GB each), the 4-GPU peer of a
  3 x 4090 box; g6.12xlarge is 4 x L4. `offers` says so.
- create: run_instances with the newest AMI named provider.ami_name (describe_images Owners/
  Filters) unless ami_id is given; the cluster's key pair (its public key imported as
  gpuctl-<cluster>; with key_name, that pair plus the cluster key via cloud-init user data); a
  security group gpuctl-<cluster> opening 22 to provider.ssh_cidr only and every port to the
  group's own members (key pair and group: aws_network.py);
  InstanceInitiatedShutdownBehavior="terminate" so `shutdown -h now` on the node ends it
  (self-teardown, budget cap; `shutdown -h +N` is the cap's backstop on every node);
  tags gpuctl-cluster=<name> on instance and volume; the root gp3 volume's throughput and IOPS sized
  so a checkpoint writes in about 5 minutes (provider.disk_throughput_mbps / disk_iops, else sizing).
- ready: running with a public IP (polled to a deadline), then an SSH banner (cloud.py).
- terminate: terminate_instances; list: describe_instances by tag; the group and key pair go
  once the instances are terminated.
Throttling and 5xx are retried by botocore (standard mode, bounded); other errors become one
line. Test-only: $GPUCTL_AWS_TEST_SSH=host:port replaces the instances' SSH address (moto's
instances run no sshd); $GPUCTL_AWS_TEST_SHUTDOWN replaces `shutdown` (the test's node is the
test machine itself).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from provision.core.errors import AuthError, ConfigError, NoOfferError, ProviderError
from provision.core.provider_config import AWSProvider, CloudProvider
from provision.core.state import ClusterRecord, NodeRecord
from provision.providers import aws_network as network
from provision.providers.aws_network import ignoring
from provision.providers.base import BOOT_HOOK, Offer, SelfTeardown
from provision.providers.cloud import CloudBackend
from provision.providers.instance import Instance
from provision.providers.labels import cluster_of

TAG = "gpuctl-cluster"
USER_TAG = "gpuctl-user"
TEST_SSH_ENV = "GPUCTL_AWS_TEST_SSH"
TEST_SHUTDOWN_ENV = "GPUCTL_AWS_TEST_SHUTDOWN"  # tests: a stand-in for `shutdown` (their "node" is this machine)
# Offline fallback only (hardware comes from describe_instance_types): on-demand Linux $/h in
# us-east-1 from the AWS price list as of PRICES_AS_OF; other regions and later prices: set
# provider.price_per_hour.
PRICES_AS_OF = "2024"
PRICES = {
    "g5.12xlarge": 5.672,
    "g5.24xlarge": 8.144,
    "g5.48xlarge": 16.288,
    "g6.12xlarge": 4.6016,
    "g6.24xlarge": 6.6749,
    "g6.48xlarge": 13.3504,
    "g6e.12xlarge": 10.493,
    "p4d.24xlarge": 32.7726,
}
AUTH_CODES = {
    "AuthFailure",
    "UnauthorizedOperation",
    "InvalidClientTokenId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "OptInRequired",
    "AccessDenied",
    "UnrecognizedClientException",
}
CAPACITY_CODES = {
    "InsufficientInstanceCapacity",
    "InstanceLimitExceeded",
    "VcpuLimitExceeded",
    "Unsupported",
    "MaxSpotInstanceCountExceeded",
}
PER_BOOT = "/var/lib/cloud/scripts/per-boot/gpuctl-guard.sh"  # cloud-init runs it at every boot
ACTIVE_STATES = ["pending", "running", "stopping", "stopped", "shutting-down"]
FAILED = ("shutting-down", "terminated", "stopping", "stopped")


def ec2(region: str | None, endpoint_url: str | None) -> Any:
    """A boto3 EC2 client (boto3 ships no type information: Any)."""
    import boto3
    from botocore.config import Config

    config = Config(retries={"mode": "standard", "max_attempts": 6}, connect_timeout=10, read_timeout=60)
    return boto3.client("ec2", region_name=region, endpoint_url=endpoint_url, config=config)


@contextmanager
def aws_errors(what: str) -> Iterator[None]:
    """botocore's exceptions -> one-line GpuctlErrors (the credentials never appear)."""
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, PartialCredentialsError

    try:
        yield
    except (NoCredentialsError, PartialCredentialsError):
        raise AuthError(f"no AWS credentials for {what}", "run `aws configure`, or set AWS_PROFILE") from None
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "?")
        message = exc.response.get("Error", {}).get("Message", "")[:200]
        if code in AUTH_CODES:
            raise AuthError(
                f"AWS refused {what} ({code})", "check AWS_PROFILE / your keys and the IAM permissions for EC2"
            ) from None
        if code in CAPACITY_CODES:
            raise NoOfferError(
                f"AWS cannot {what} now ({code}: {message})", "retry later, another region, or raise your EC2 quota"
            ) from None
        if (
            code in ("RequestLimitExceeded", "Throttling")
            or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) >= 500
        ):
            raise ProviderError(f"AWS kept failing on {what} ({code})", "wait a few minutes and retry") from None
        raise ProviderError(f"AWS {what}: {code}: {message}") from None
    except BotoCoreError as exc:
        raise ProviderError(f"AWS {what}: {exc}", "check the network and provider.region / api_url") from None


def shutdown_argv(user: str | None, when: str) -> list[str]:
    """`shutdown -h WHEN` as the node's login user runs it (sudo -n unless root)."""
    test = os.environ.get(TEST_SHUTDOWN_ENV)
    if test:
        return [test, "-h", when]
    sudo = [] if (user or "root") == "root" else ["sudo", "-n"]
    return [*sudo, "shutdown", "-h", when]


def user_data(prov: AWSProvider, public_key: str | None) -> str:
    """cloud-config: a per-boot script that runs the budget guard's boot hook, as the login user,
    at every boot (a rebooted machine's guards start again, deadlines unchanged: flows/guard.py);
    with key_name, gpuctl's own key too (the user's pair is then the instance's key pair)."""
    import yaml

    user = shlex.quote(prov.ssh_user)
    workdir = shlex.quote(prov.workdir) if prov.workdir else f'"$(getent passwd {user} | cut -d: -f6)/gpuctl"'
    script = (
        "#!/bin/bash\n# gpuctl: start the budget guards again after a reboot (none before `gpuctl up` wrote them)\n"
        f"export GPUCTL_WORKDIR={workdir}\nexec runuser -u {user} -- bash -c {shlex.quote(BOOT_HOOK)}\n"
    )
    doc: dict[str, Any] = {"write_files": [{"path": PER_BOOT, "permissions": "0755", "content": script}]}
    if public_key:
        doc["ssh_authorized_keys"] = [public_key]
    return "#cloud-config\n" + str(yaml.safe_dump(doc, sort_keys=False))


def _tags(cluster: str, extra: dict[str, str] | None = None) -> list[dict[str, str]]:
    tags = {TAG: cluster, "Name": f"gpuctl-{cluster}", **(extra or {})}
    return [{"Key": k, "Value": v} for k, v in tags.items()]


class AWSBackend(CloudBackend):
    kind = "aws"

    def client(self, cluster: ClusterRecord) -> Any:
        return ec2(cluster.region, cluster.api_url)

    def filters_text(self, prov: CloudProvider) -> str:
        assert isinstance(prov, AWSProvider)
        return (
            f"(instance_type={prov.instance_type} in {prov.region}, >= {prov.gpus_per_node} x {prov.gpu}, "
            f"memory>={prov.min_ram_gb:g} GB"
            + (f", price<=${prov.max_price}/h" if prov.max_price else "")
            + "; EC2 rents no RTX 4090)"
        )

    def find_offers(self, prov: CloudProvider) -> list[Offer]:
        assert isinstance(prov, AWSProvider)
        client = ec2(prov.region, prov.api_url)
        with aws_errors(f"describe instance type {prov.instance_type}"):
            offered = client.describe_instance_type_offerings(
                LocationType="region", Filters=[{"Name": "instance-type", "Values": [prov.instance_type]}]
            )
            if not offered.get("InstanceTypeOfferings"):
                return []
            info = client.describe_instance_types(InstanceTypes=[prov.instance_type])["InstanceTypes"][0]
        gpus = (info.get("GpuInfo") or {}).get("Gpus") or [{}]
        count, name = sum(g.get("Count", 0) for g in gpus), gpus[0].get("Name", "none")
        gpu_gib = (gpus[0].get("MemoryInfo") or {}).get("SizeInMiB", 0) / 1024
        ram_gb = info["MemoryInfo"]["SizeInMiB"] / 1024
        price = prov.price_per_hour or PRICES.get(prov.instance_type)
        if price is None:
            raise ConfigError(
                f"gpuctl has no price for {prov.instance_type}",
                "set provider.price_per_hour (on-demand $/h) so cost and caps are right",
            )
        if count < prov.gpus_per_node or ram_gb < prov.min_ram_gb or (prov.max_price and price > prov.max_price):
            return []
        if prov.gpu.lower() not in name.lower():
            return []
        source = "provider.price_per_hour" if prov.price_per_hour else f"us-east-1 table of {PRICES_AS_OF}"
        return [
            Offer(
                id=prov.instance_type,
                gpu_name=name,
                num_gpus=count,
                price_per_hour=price,
                ram_gb=ram_gb,
                disk_gb=prov.disk_gb,
                where=f"{prov.region}, {gpu_gib:.1f} GiB per GPU, price: {source}",
            )
        ]

    def prepare(self, prov: CloudProvider, cluster: ClusterRecord, public_key: str) -> None:
        assert isinstance(prov, AWSProvider)
        client = self.client(cluster)
        cidr = prov.ssh_cidr or network.caller_cidr()
        name = f"gpuctl-{cluster.name}"
        with aws_errors("create the key pair and security group"):
            if not prov.key_name:
                network.import_key_pair(client, name, public_key, _tags(cluster.name))
            network.open_security_group(
                client, name, cidr, f"gpuctl cluster {cluster.name}: SSH from {cidr}", _tags(cluster.name)
            )

    def _ami(self, client: Any, prov: AWSProvider) -> tuple[str, str]:
        """(image id, root device name): ami_id, else the newest image named ami_name."""
        with aws_errors(f"look up the AMI {prov.ami_id or prov.ami_name!r}"):
            if prov.ami_id:
                images = client.describe_images(ImageIds=[prov.ami_id])["Images"]
            else:
                images = client.describe_images(
                    Owners=[prov.ami_owner],
                    Filters=[{"Name": "name", "Values": [prov.ami_name]}, {"Name": "state", "Values": ["available"]}],
                )["Images"]
        if not images:
            raise NoOfferError(
                f"no AMI named {prov.ami_name!r} owned by {prov.ami_owner} in {prov.region}",
                "set provider.ami_name / ami_owner, or ami_id",
            )
        newest = max(images, key=lambda i: (i.get("CreationDate", ""), i.get("Name", "")))  # names carry dates
        return newest["ImageId"], newest.get("RootDeviceName") or "/dev/sda1"

    def launch(self, prov: CloudProvider, cluster: ClusterRecord, label: str, offer: Offer, public_key: str) -> str:
        assert isinstance(prov, AWSProvider)
        client = self.client(cluster)
        image_id, root = self._ami(client, prov)
        name = f"gpuctl-{cluster.name}"
        tags = _tags(cluster.name, {USER_TAG: prov.ssh_user, "Name": label})
        ebs: dict[str, Any] = {"VolumeSize": int(prov.disk_gb), "VolumeType": "gp3", "DeleteOnTermination": True}
        if prov.disk_throughput_mbps:  # sized by plan's checkpoint (provision.estimate.sizing.gp3_performance)
            ebs.update(Throughput=prov.disk_throughput_mbps, Iops=prov.disk_iops or 3000)
        args = dict(
            ImageId=image_id,
            InstanceType=offer.id,
            MinCount=1,
            MaxCount=1,
            KeyName=prov.key_name or name,
            SecurityGroupIds=[network.group_id(client, name)],
            InstanceInitiatedShutdownBehavior="terminate",
            ClientToken=label[:64],  # botocore's retries of this call create one instance
            BlockDeviceMappings=[{"DeviceName": root, "Ebs": ebs}],
            TagSpecifications=[{"ResourceType": "instance", "Tags": tags}, {"ResourceType": "volume", "Tags": tags}],
        )
        args["UserData"] = user_data(prov, public_key if prov.key_name else None)
        with aws_errors(f"run a {offer.id} instance"):
            instance_id: str = client.run_instances(**args)["Instances"][0]["InstanceId"]
        return instance_id

    def describe(self, cluster: ClusterRecord, instance_id: str) -> Instance | None:
        with aws_errors(f"describe instance {instance_id}"):
            found = ignoring(
                {"InvalidInstanceID.NotFound"}, self.client(cluster).describe_instances, InstanceIds=[instance_id]
            )
        raws = [i for r in (found or {}).get("Reservations", []) for i in r["Instances"]]
        return self._instance(raws[0]) if raws else None

    def _instance(self, raw: dict[str, Any]) -> Instance:
        status = raw["State"]["Name"]
        tags = {t["Key"]: t["Value"] for t in raw.get("Tags") or []}
        address, port, private = raw.get("PublicIpAddress"), 22, raw.get("PrivateIpAddress")
        if os.environ.get(TEST_SSH_ENV) and address:
            host, _, test_port = os.environ[TEST_SSH_ENV].rpartition(":")
            address, port, private = host, int(test_port), host
        return Instance(
            id=raw["InstanceId"],
            state=status,
            ready=status == "running" and bool(address),
            failed=status in FAILED,
            address=address,
            port=port,
            user=tags.get(USER_TAG, "ubuntu"),
            label=tags.get("Name", ""),
            private_address=private,
            price_per_hour=PRICES.get(str(raw.get("InstanceType"))),  # the table: an estimate, for `sweep`
        )

    def terminate(self, cluster: ClusterRecord, instance_id: str) -> None:
        with aws_errors(f"terminate instance {instance_id}"):
            ignoring(
                {"InvalidInstanceID.NotFound"}, self.client(cluster).terminate_instances, InstanceIds=[instance_id]
            )

    def list_instances(self, cluster: ClusterRecord) -> list[Instance]:
        client = self.client(cluster)
        with aws_errors("list instances"):
            found = client.describe_instances(
                Filters=[
                    {"Name": f"tag:{TAG}", "Values": [cluster.name]},
                    {"Name": "instance-state-name", "Values": ACTIVE_STATES},
                ]
            )
        return [self._instance(i) for r in found["Reservations"] for i in r["Instances"]]

    def list_ours(self, account: ClusterRecord) -> list[Instance]:
        """Every live instance of the region tagged gpuctl-cluster, whatever the cluster."""
        client = self.client(account)
        filters = [{"Name": "tag-key", "Values": [TAG]}, {"Name": "instance-state-name", "Values": ACTIVE_STATES}]
        with aws_errors("list instances"):
            pages = list(client.get_paginator("describe_instances").paginate(Filters=filters))
        found = [self._instance(i) for page in pages for r in page["Reservations"] for i in r["Instances"]]
        return [i for i in found if cluster_of(i.label)]

    def account_missing(self) -> str | None:
        import boto3
        from botocore.exceptions import BotoCoreError

        try:
            session = boto3.session.Session()
            found = session.get_credentials() is not None
        except BotoCoreError as exc:
            return f"AWS credentials: {type(exc).__name__}"
        return None if found else "no AWS credentials (AWS_PROFILE, ~/.aws, AWS_ACCESS_KEY_ID)"

    def default_account(self) -> ClusterRecord | None:
        """The region boto3 is configured for; None without one (no AWS account to look at)."""
        import boto3

        region = boto3.session.Session().region_name
        return ClusterRecord(name="sweep", provider=self.kind, nodes=[], region=region) if region else None

    def release(self, cluster: ClusterRecord, say: Callable[[str], None]) -> None:
        """Delete the security group and the imported key pair (free, but not ours to leave)."""
        with aws_errors("delete the security group and key pair"):
            network.delete_key_pair_and_group(self.client(cluster), f"gpuctl-{cluster.name}", say)

    def self_teardown(self, cluster: ClusterRecord) -> SelfTeardown | None:
        """`shutdown -h now` with InstanceInitiatedShutdownBehavior=terminate: the node ends itself.

        With more nodes the first one first shuts the others down through the cluster's own ssh
        config and key (<workdir>/ssh/config, written by mesh.setup: the same way pdsh goes),
        over their private addresses, which the cluster's security group admits. No AWS key
        on the node. A node it cannot reach still has its own `shutdown -h +N` (backstop)."""
        first = cluster.nodes[0] if cluster.nodes else None
        if first is None:
            return None
        own = shutdown_argv(first.user, "now")
        others = cluster.nodes[1:]
        if not others:
            return SelfTeardown(argv=own)
        from provision.transport.ssh.mesh import node_ssh_config

        config = node_ssh_config(first.workdir)
        lines = [
            f"{shlex.join(['ssh', '-F', config, '-o', 'ConnectTimeout=20', n.host.split('@')[-1], shlex.join(shutdown_argv(n.user, 'now'))])}"
            f" || echo {shlex.quote(f'gpuctl: could not reach {n.host} to shut it down')}"
            for n in others
        ]
        return SelfTeardown(argv=["bash", "-c", "\n".join([*lines, shlex.join(own)])])

    def node_teardown(self, cluster: ClusterRecord, node: NodeRecord) -> SelfTeardown | None:
        """`shutdown -h now` on that node alone (its own guard, a little after the cap)."""
        return SelfTeardown(argv=shutdown_argv(node.user, "now"))

    def backstop(self, cluster: ClusterRecord, node: NodeRecord, minutes: int) -> list[str] | None:
        """`shutdown -h +N` on every node: terminated by EC2 even if the budget guard is gone."""
        return shutdown_argv(node.user, f"+{int(minutes)}")


BACKEND = AWSBackend()

"""The `aws` provider's network: the cluster's key pair and its security group (see aws.py).

The group gpuctl-<cluster> opens 22 to provider.ssh_cidr only (default: your public IP/32) and
every port to the group's own members (pdsh and NCCL between nodes, over their private
addresses). Both are free, but not ours to leave: they go once the instances are terminated.
These take a boto3 EC2 client and let botocore's errors through: the caller wraps them in
aws.aws_errors (one line each)."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from typing import Any, TypeVar

from provision.core.errors import ConfigError

GROUP_IN_USE_WAIT_S = 120  # a terminating instance holds its group for about a minute
_T = TypeVar("_T")


def _client_error_code(exc: BaseException) -> str:
    code: str = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
    return code


def ignoring(codes: set[str], call: Callable[..., _T], **kwargs: Any) -> _T | None:
    """call(**kwargs), with an AWS error whose code is in `codes` answered as None."""
    from botocore.exceptions import ClientError

    try:
        return call(**kwargs)
    except ClientError as exc:
        if _client_error_code(exc) in codes:
            return None
        raise


def caller_cidr() -> str:
    try:
        with urllib.request.urlopen("https://checkip.amazonaws.com", timeout=10) as resp:
            ip = resp.read().decode().strip()
    except OSError:
        raise ConfigError(
            "could not find your public IP for the SSH security group rule",
            "set provider.ssh_cidr, e.g. 203.0.113.7/32",
        ) from None
    return f"{ip}/32"


def group_id(client: Any, name: str) -> str | None:
    groups = client.describe_security_groups(Filters=[{"Name": "group-name", "Values": [name]}])
    return groups["SecurityGroups"][0]["GroupId"] if groups["SecurityGroups"] else None


def delete_key_pair(client: Any, name: str) -> None:
    ignoring({"InvalidKeyPair.NotFound"}, client.delete_key_pair, KeyName=name)


def import_key_pair(client: Any, name: str, public_key: str, tags: list[dict[str, str]]) -> None:
    """The cluster's public key as the pair `name` (a stale pair of that name is replaced)."""
    delete_key_pair(client, name)
    client.import_key_pair(
        KeyName=name,
        PublicKeyMaterial=public_key.encode(),
        TagSpecifications=[{"ResourceType": "key-pair", "Tags": tags}],
    )


def open_security_group(client: Any, name: str, cidr: str, description: str, tags: list[dict[str, str]]) -> str:
    """The group `name` (created unless it exists) with its two rules; returns its id."""
    found = group_id(client, name)
    if found is None:
        found = client.create_security_group(
            GroupName=name,
            Description=description,
            TagSpecifications=[{"ResourceType": "security-group", "Tags": tags}],
        )["GroupId"]
    ssh = {
        "IpProtocol": "tcp",
        "FromPort": 22,
        "ToPort": 22,
        "IpRanges": [{"CidrIp": cidr, "Description": "gpuctl ssh"}],
    }
    ignoring(
        {"InvalidPermission.Duplicate"}, client.authorize_security_group_ingress, GroupId=found, IpPermissions=[ssh]
    )
    # The cluster's own members reach each other on every port: pdsh's SSH, the rendezvous
    # (MASTER_PORT) and NCCL's sockets. Only members of this group; over private addresses.
    members = {"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": found, "Description": "gpuctl cluster nodes"}]}
    ignoring(
        {"InvalidPermission.Duplicate"}, client.authorize_security_group_ingress, GroupId=found, IpPermissions=[members]
    )
    return found


def delete_key_pair_and_group(client: Any, name: str, say: Callable[[str], None]) -> None:
    """Delete the pair and the group `name`; a group still held past the wait is left with a warning."""
    deadline = time.monotonic() + GROUP_IN_USE_WAIT_S
    delete_key_pair(client, name)
    while (found := group_id(client, name)) is not None:
        # A terminating instance still holds the group (DependencyViolation): wait for it.
        if ignoring({"DependencyViolation"}, client.delete_security_group, GroupId=found) is None:
            if time.monotonic() > deadline:
                say(f"warning: security group {found} is still in use; delete it later")
                return
            time.sleep(5)

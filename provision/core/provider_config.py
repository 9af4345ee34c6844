"""gpuctl.yaml's `provider:` section: where the nodes come from (this machine, your SSH hosts, or
a cloud vendor), one pydantic model per kind, told apart by `kind`. Strict is the base of every
gpuctl.yaml model (provision/core/config.py holds the rest of the file's sections)."""

from __future__ import annotations

import re
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

HOST_RE = re.compile(r"^(?:(?P<user>[A-Za-z0-9._-]+)@)?(?P<host>[A-Za-z0-9.:_-]+?)(?::(?P<port>\d{1,5}))?$")


class Strict(BaseModel):
    # allow_inf_nan=False: `.inf` / `.nan` in YAML are errors, never a budget cap that never comes.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class LocalProvider(Strict):
    """This machine is the node: GPUs when nvidia-smi sees them, else CPU ranks over gloo."""

    kind: Literal["local"] = "local"
    gpus_per_node: int | None = Field(default=None, ge=1, le=64, description="GPUs to use; None = all visible")
    cpu_ranks: int = Field(default=3, ge=1, le=64, description="ranks to start when there is no GPU")
    python: str | None = Field(default=None, description="interpreter with torch+deepspeed; default: gpuctl's own")


class SSHProvider(Strict):
    """Machines you already have, reached over SSH."""

    kind: Literal["ssh"] = "ssh"
    hosts: list[str] = Field(
        ..., min_length=1, description="user@host:port or a Host alias of ssh_config, one per node"
    )
    identity_file: str | None = Field(default=None, description="private key for the hosts")
    ssh_config: str | None = Field(
        default=None, description="OpenSSH client config for host aliases and ProxyJump; default ~/.ssh/config"
    )
    gpus_per_node: int | None = Field(default=None, ge=1, le=64, description="None = what nvidia-smi reports")
    cpu_ranks: int = Field(default=3, ge=1, le=64, description="ranks per node when a node has no GPU")
    python: str = Field(default="python3", description="interpreter on the node with torch+deepspeed")
    setup: str | None = Field(default=None, description="shell command run on the node before each job")
    runtime: Literal["auto", "docker", "none"] = "auto"
    image: str | None = Field(default=None, description="container image for runtime docker")
    connect_timeout: float = Field(default=10, gt=0, le=600)
    ready_timeout: float = Field(default=120, gt=0, le=3600, description="retry a booting node until then")
    workdir: str | None = Field(
        default=None,
        description="node folder for run dirs (same path on every node); default <first node's $HOME>/gpuctl",
    )
    authorized_keys: str = Field(
        default="~/.ssh/authorized_keys",
        description="file the nodes' sshd reads keys "
        "from; with 2+ hosts gpuctl adds the cluster's own key there for pdsh",
    )

    @field_validator("hosts")
    @classmethod
    def _hosts_parse(cls, hosts: list[str]) -> list[str]:
        for host in hosts:
            match = HOST_RE.match(host)
            if not match or (match["port"] and not 0 < int(match["port"]) < 65536):
                raise ValueError(f"host {host!r} is not user@host[:port]")
        if len(set(hosts)) != len(hosts):
            raise ValueError("hosts are listed twice")
        return hosts


class CloudProvider(Strict):
    """Fields shared by the rented-machine providers."""

    gpu: str = Field(default="RTX 4090", description="GPU model to rent")
    gpus_per_node: int = Field(default=3, ge=1, le=16)
    nodes: int = Field(default=1, ge=1, le=64)
    min_ram_gb: float = Field(
        default=128,
        ge=0,
        le=65536,
        description="host RAM per node; unset: `gpuctl plan`'s per-node figure for this config, at least 128 "
        "(DeepSeek-7B, ZeRO-2 offload, 3 GPUs: 154)",
    )
    disk_gb: float = Field(
        default=200,
        gt=0,
        le=65536,
        description="node disk; unset: plan's figure (model download, keep_local + 1 checkpoints, image), at least 200",
    )
    max_price: float | None = Field(default=None, gt=0, le=10_000, description="$/h per node ceiling")
    max_hours: float | None = Field(
        default=None, gt=0, le=24 * 366, description="node tears itself down after this (hours from `up`)"
    )
    max_cost: float | None = Field(
        default=None, gt=0, le=1_000_000, description="node tears itself down after spending this ($)"
    )
    image: str = Field(default="ghcr.io/gpuctl/trainer:0.1.0", description="container image for the node")
    runtime: Literal["auto", "docker", "image", "none"] = Field(
        default="auto", description="auto: vast/runpod boot the image, aws runs it with docker"
    )
    api_url: str | None = Field(
        default=None, description="vendor API base (a proxy or test server); default the vendor's"
    )
    python: str = "python3"
    ready_timeout: float = Field(default=900, gt=0, le=7200, description="seconds a new node has to answer SSH")
    workdir: str | None = Field(default=None, description="node folder for run dirs; default $HOME/gpuctl")
    cpu_ranks_fallback: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="a node that shows no GPU runs this many CPU ranks (test stand-ins); "
        "None: a node without a visible GPU is an error and is terminated",
    )


class VastProvider(CloudProvider):
    kind: Literal["vast"] = "vast"
    reliability: float = Field(default=0.98, ge=0, le=1)
    verified: bool = True
    interruptible: bool = False  # bid offers (search type "bid", create with a `price`)
    bid_per_gpu: float | None = Field(default=None, gt=0, le=1000, description="bid $/h per GPU; default the minimum")


class RunPodProvider(CloudProvider):
    kind: Literal["runpod"] = "runpod"
    gpu: str = Field(default="NVIDIA GeForce RTX 4090", description="RunPod gpuTypeId")
    cloud_type: Literal["SECURE", "COMMUNITY", "ALL"] = "ALL"
    interruptible: bool = False
    bid_per_gpu: float | None = Field(
        default=None, gt=0, le=1000, description="spot bid $/h per GPU; default the current minimum"
    )


class AWSProvider(CloudProvider):
    kind: Literal["aws"] = "aws"
    gpu: str = "A10G"
    gpus_per_node: int = Field(default=4, ge=1, le=16)
    instance_type: str = "g5.12xlarge"
    region: str = "us-east-1"
    ami_name: str = "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) *"
    ami_owner: str = Field(default="amazon", description="describe_images Owners: amazon, self, or an account id")
    ami_id: str | None = Field(default=None, description="use this AMI instead of looking ami_name up")
    key_name: str | None = Field(
        default=None,
        description="also let this existing EC2 key pair log in; gpuctl "
        "itself always uses the cluster's own key (imported, or via user data)",
    )
    ssh_user: str = Field(default="ubuntu", description="login user of the AMI")
    ssh_cidr: str | None = Field(default=None, description="who may reach port 22; default your public IP/32")
    price_per_hour: float | None = Field(
        default=None,
        gt=0,
        le=10_000,
        description="$/h per node for cost and caps; default gpuctl's on-demand table for the type",
    )
    disk_throughput_mbps: int | None = Field(
        default=None,
        ge=125,
        le=1000,
        description="root gp3 volume MiB/s; default sized by plan so a checkpoint writes in 5 minutes",
    )
    disk_iops: int | None = Field(default=None, ge=3000, le=16000, description="root gp3 volume IOPS; default sized")


Provider = Annotated[
    Union[LocalProvider, SSHProvider, VastProvider, RunPodProvider, AWSProvider],
    Field(discriminator="kind"),
]

"""gpuctl.yaml's `provider:` section: where the nodes come from (this machine, your SSH hosts, or
a cloud vendor), one pydantic model per kind, told apart by `kind`. Strict is the base of every
gpuctl.yaml model (provision/core/config.py holds the rest of the file's sections)."""

from __future__ import annotations

import re
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from provision import __version__

# The driver CUDA the trainer image needs: its base and torch build are CUDA 12.8 (Dockerfile's BASE_IMAGE,
# images/requirements-torch-cuda.txt's `# cuda:` pin; tests/test_init.py keeps the three in agreement).
# Renting providers rent only hosts whose driver speaks at least this (vast cuda_max_good, runpod
# allowedCudaVersions): an older driver fails the doctor after the host is rented, still billing.
IMAGE_CUDA = "12.8"
# The prebuilt trainer image of this release, derived from the package version (the release
# workflow, .github/workflows/release.yml, tags what it pushes the same way).
IMAGE_REPO = "ghcr.io/gpuctl/trainer"
DEFAULT_IMAGE = f"{IMAGE_REPO}:{__version__}"
# A private image's registry login (provider.registry_user or the user's env; docker.ship pull and
# `image build --push` read the same): the password from the environment, never the config file, the
# state dir or a command line.
REGISTRY_USER_ENV, REGISTRY_PASSWORD_ENV = "GPUCTL_REGISTRY_USER", "GPUCTL_REGISTRY_PASSWORD"
SLURM_WORD = re.compile(r"^[A-Za-z0-9_.:,&|\[\]*=+-]{1,200}$")
HOST_RE = re.compile(r"^(?:(?P<user>[A-Za-z0-9._-]+)@)?(?P<host>[A-Za-z0-9.:_-]+?)(?::(?P<port>\d{1,5}))?$")


class Strict(BaseModel):
    # allow_inf_nan=False: `.inf` / `.nan` in YAML are errors, never a budget cap that never comes.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class LocalProvider(Strict):
    """This machine is the node: GPUs when nvidia-smi sees them, else CPU ranks over gloo."""

    kind: Literal["local"] = Field(
        default="local", description="local | ssh | vast | runpod | aws | slurm. local: this machine is the node"
    )
    gpus_per_node: int | None = Field(
        default=None, ge=1, le=64, description="GPUs to use; null = every GPU nvidia-smi sees"
    )
    cpu_ranks: int = Field(
        default=3, ge=1, le=64, description="ranks to start when the machine has no GPU (DeepSpeed on CPU over gloo)"
    )
    python: str | None = Field(
        default=None, description="interpreter with torch + deepspeed + transformers; null = the one gpuctl runs in"
    )


class SSHProvider(Strict):
    """Machines you already have, reached over SSH."""

    kind: Literal["ssh"] = Field(
        default="ssh",
        description="local | ssh | vast | runpod | aws | slurm. ssh: machines you already have, reached over SSH",
    )
    hosts: list[str] = Field(
        ...,
        min_length=1,
        description="one per node: user@host:port, or a Host alias of your ssh config (ProxyJump bastions included)",
    )
    identity_file: str | None = Field(
        default=None,
        description="private key for the hosts; null = the alias's IdentityFile, then your ssh-agent and ~/.ssh/id_*",
    )
    ssh_config: str | None = Field(
        default=None,
        description="OpenSSH client config the aliases (and their ProxyJump) are looked up in; null = ~/.ssh/config",
    )
    gpus_per_node: int | None = Field(
        default=None, ge=1, le=64, description="GPUs per node; null = what nvidia-smi reports"
    )
    cpu_ranks: int = Field(default=3, ge=1, le=64, description="ranks per node when a node has no GPU")
    python: str = Field(default="python3", description="interpreter on the node with torch + deepspeed + transformers")
    setup: str | None = Field(
        default=None,
        description='shell command run on the node before each job (e.g. "source ~/venv/bin/activate"); null = none',
    )
    runtime: Literal["auto", "docker", "none"] = Field(
        default="auto",
        description="docker runs the launcher in provider.image (auto: when the node has docker and image is set); none: the node's python",
    )
    image: str | None = Field(
        default=None, description="container image for runtime docker (`gpuctl image build`); null = none"
    )
    connect_timeout: float = Field(default=10, gt=0, le=600, description="seconds to wait for an SSH connection")
    ready_timeout: float = Field(
        default=120, gt=0, le=3600, description="seconds a booting node is retried before `up` gives up"
    )
    workdir: str | None = Field(
        default=None,
        description="node folder for run dirs (same path on every node); null = <first node's $HOME>/gpuctl",
    )
    authorized_keys: str = Field(
        default="~/.ssh/authorized_keys",
        description="the file the nodes' sshd reads keys from; with 2+ hosts gpuctl adds the cluster's own key there (pdsh)",
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
    gpus_per_node: int = Field(
        default=3, ge=1, le=16, description="GPUs per node; 3 x RTX 4090 is the target run (batch 1 x 4 x 3 = 12)"
    )
    nodes: int = Field(default=1, ge=1, le=64, description="nodes (one machine each)")
    min_ram_gb: float = Field(
        default=128,
        ge=0,
        le=65536,
        description="host RAM per node, GB; null = `gpuctl plan`'s figure for this config, at least 128 (DeepSeek-7B, ZeRO-2 with CPU Adam, 3 GPUs: 168)",
    )
    disk_gb: float = Field(
        default=200,
        gt=0,
        le=65536,
        description="node disk, GB; null = plan's figure (the model download, keep_local + 1 checkpoints, the image), at least 200 (DeepSeek-7B: 325)",
    )
    max_price: float | None = Field(default=None, gt=0, le=10_000, description="$/h per node ceiling; null = any price")
    max_hours: float | None = Field(
        default=None,
        gt=0,
        le=24 * 366,
        description="budget cap, hours counted from `up`: the node stops the run and deletes itself then, whatever the run is doing; null = no cap",
    )
    max_cost: float | None = Field(
        default=None,
        gt=0,
        le=1_000_000,
        description="budget cap, dollars: the node stops the run and deletes itself once the cluster has cost this; null = no cap",
    )
    image: str = Field(
        default=DEFAULT_IMAGE,
        description="container image the node runs; `gpuctl image build --push` makes it",
    )
    runtime: Literal["auto", "docker", "image", "bootstrap", "none"] = Field(
        default="auto",
        description="auto: vast/runpod boot provider.image, or with none set a vendor PyTorch image and "
        "install the pinned node side at first boot (bootstrap); aws runs the image with docker; none: the host's python",
    )
    api_url: str | None = Field(
        default=None,
        description="vendor API base (a proxy or a test server); null = the vendor's (https://console.vast.ai, https://api.runpod.io/graphql, EC2's endpoint for the region)",
    )
    python: str = Field(
        default="python3", description="interpreter on the node (the image's venv; on aws without docker, the AMI's)"
    )
    ready_timeout: float = Field(
        default=900, gt=0, le=7200, description='seconds a new node has to answer SSH (a login, not just "running")'
    )
    workdir: str | None = Field(default=None, description="node folder for run dirs; null = $HOME/gpuctl")
    cpu_ranks_fallback: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="CPU ranks on a node that shows no GPU (test stand-ins only); null = such a node is an error and is terminated",
    )

    @model_validator(mode="before")
    @classmethod
    def _null_is_plans(cls, data: object) -> object:
        """`min_ram_gb: null` / `disk_gb: null` (what `gpuctl init` writes) leave them unset: plan's figures."""
        if isinstance(data, dict) and any(data.get(k, 0) is None for k in ("min_ram_gb", "disk_gb")):
            return {k: v for k, v in data.items() if not (k in ("min_ram_gb", "disk_gb") and v is None)}
        return data


class MarketProvider(CloudProvider):
    """The hosts of a marketplace (vast, runpod) differ in driver and uplink: filter on both."""

    image: str | None = Field(  # type: ignore[assignment]
        default=None,
        description="container image the node boots; null = a public PyTorch image the vendor's hosts cache, "
        "with the node side installed at first boot (runtime bootstrap); the release's prebuilt image "
        f"({DEFAULT_IMAGE}, `gpuctl image build --push`) skips that install",
    )
    registry_user: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._@+-]{0,127}$",
        description="user of a private provider.image's registry (ghcr.io: your GitHub user); its password or token "
        f"comes from ${REGISTRY_PASSWORD_ENV} when `up` runs, never from this file; null = ${REGISTRY_USER_ENV}, "
        "else a public image",
    )

    max_final_upload_min: float = Field(
        default=30,
        gt=0,
        le=24 * 60,
        description="hosts are filtered on their uplink: the final checkpoint (plan's size on node 0; DeepSeek-7B ~97 GB, so >= 430 Mbit/s in 30 min) must reach storage.url within this many minutes; and on a driver that runs the image's CUDA 12.8. `gpuctl offers` shows both",
    )
    min_upload_mbps: float | None = Field(
        default=None,
        ge=0,
        le=1_000_000,
        description="host upload, Mbit/s; null = plan's final checkpoint over max_final_upload_min",
    )

    @model_validator(mode="after")
    def _registry_needs_image(self) -> MarketProvider:
        if self.registry_user and not self.image:
            raise ValueError("registry_user is set but provider.image is not: name the private image it logs in to")
        return self


class VastProvider(MarketProvider):
    kind: Literal["vast"] = Field(
        default="vast",
        description="local | ssh | vast | runpod | aws | slurm. vast: Vast.ai, rented by the hour; `gpuctl offers` lists what matches",
    )
    gpu: str = Field(default="RTX 4090", description="GPU model to rent (Vast.ai's gpu_name)")
    reliability: float = Field(default=0.98, ge=0, le=1, description="offer filter: the host's reliability score")
    verified: bool = Field(default=True, description="offer filter: Vast-verified hosts only")
    interruptible: bool = Field(
        default=False, description="true: bid (interruptible) offers, cheaper but preempted when outbid (see Recovery)"
    )
    bid_per_gpu: float | None = Field(
        default=None, gt=0, le=1000, description="bid $/h per GPU; null = the offer's minimum"
    )


class RunPodProvider(MarketProvider):
    kind: Literal["runpod"] = Field(
        default="runpod",
        description="local | ssh | vast | runpod | aws | slurm. runpod: RunPod, rented by the hour; `gpuctl offers` lists what matches",
    )
    gpu: str = Field(default="NVIDIA GeForce RTX 4090", description="GPU model to rent (RunPod's gpuTypeId)")
    cloud_type: Literal["SECURE", "COMMUNITY", "ALL"] = Field(
        default="ALL", description="RunPod's data-center or community hosts, or the cheaper of both"
    )
    interruptible: bool = Field(default=False, description="true: spot pods, cheaper but preempted (see Recovery)")
    bid_per_gpu: float | None = Field(
        default=None, gt=0, le=1000, description="spot bid $/h per GPU; null = the current minimum"
    )


class AWSProvider(CloudProvider):
    kind: Literal["aws"] = Field(
        default="aws",
        description="local | ssh | vast | runpod | aws | slurm. aws: EC2, rented by the hour; `gpuctl offers` lists what matches",
    )
    gpu: str = Field(
        default="A10G",
        description="GPU model of instance_type (EC2 rents no RTX 4090: g5.12xlarge is 4 x A10G, 24 GB each)",
    )
    gpus_per_node: int = Field(
        default=4,
        ge=1,
        le=16,
        description="GPUs per node: the instance type's 4 (batch 1 x 4 x 4 = 16; 3 of them keeps the target's batch 12)",
    )
    instance_type: str = Field(default="g5.12xlarge", description="EC2 instance type")
    region: str = Field(default="us-east-1", description="EC2 region (credentials: boto3's chain, e.g. AWS_PROFILE)")
    ami_name: str = Field(
        default="Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) *",
        description="the newest AMI of this name and ami_owner (unless ami_id pins one)",
    )
    ami_owner: str = Field(default="amazon", description="describe_images Owners: amazon, self, or an account id")
    ami_id: str | None = Field(
        default=None, description="pin this AMI instead of looking ami_name up; null = look it up"
    )
    key_name: str | None = Field(
        default=None,
        description="also let this existing EC2 key pair log in (gpuctl itself uses the cluster's own key); null = none",
    )
    ssh_user: str = Field(default="ubuntu", description="login user of the AMI")
    ssh_cidr: str | None = Field(default=None, description="who may reach port 22; null = your public IP/32")
    price_per_hour: float | None = Field(
        default=None,
        gt=0,
        le=10_000,
        description="$/h per node for cost and the cap; null = gpuctl's us-east-1 on-demand table",
    )
    disk_throughput_mbps: int | None = Field(
        default=None,
        ge=125,
        le=1000,
        description="root gp3 volume speed, MiB/s; null = sized by plan so one checkpoint writes in 5 minutes (gp3's default 125 MiB/s would block training ~13 minutes per DeepSeek-7B save)",
    )
    disk_iops: int | None = Field(
        default=None, ge=3000, le=16000, description="root gp3 volume IOPS; null = sized with the throughput"
    )


class SlurmProvider(Strict):
    """A Slurm cluster: gpuctl submits, follows and cancels one batch job per run through the login
    node; Slurm schedules. Nothing is held while idle (`up` only checks and records)."""

    kind: Literal["slurm"] = Field(
        default="slurm",
        description="local | ssh | vast | runpod | aws | slurm. slurm: one batch job per run on a Slurm cluster",
    )
    login: str = Field(
        default="local",
        description="`local` when gpuctl runs on the login node, else user@host[:port] or an ssh_config Host alias",
    )
    identity_file: str | None = Field(default=None, description="private key for an ssh login")
    ssh_config: str | None = Field(default=None, description="OpenSSH client config for the login alias")
    partition: str | None = Field(default=None, description="sbatch --partition; None: the cluster's default")
    account: str | None = Field(default=None, description="sbatch --account")
    qos: str | None = Field(default=None, description="sbatch --qos")
    nodes: int = Field(default=1, ge=1, le=64, description="nodes per job (one task each; ranks on every node)")
    gpus_per_node: int | None = Field(default=None, ge=1, le=64, description="GPUs per node; None: CPU ranks")
    gpu_request: Literal["auto", "gres", "gpus-per-node"] = Field(
        default="auto",
        description="how the job asks for GPUs: --gres=gpu:N or --gpus-per-node N; auto: what the site's "
        "`scontrol show config` shows (select/cons_tres: --gpus-per-node, else --gres), decided at `up`",
    )
    cpu_ranks: int = Field(default=1, ge=1, le=256, description="ranks per node when gpus_per_node is unset")
    cpus_per_task: int | None = Field(default=None, ge=1, le=4096, description="--cpus-per-task (one task per node)")
    mem: str | None = Field(default=None, description="--mem per node, e.g. 64G")
    time: str = Field(default="1:00:00", description="the job's walltime (--time): this provider's budget cap")
    constraint: str | None = Field(default=None, description="--constraint (node features)")
    save_before_walltime_s: int = Field(
        default=300,
        ge=30,
        le=65535,
        description="seconds before the walltime Slurm signals the ranks (USR1) to save a checkpoint and stop",
    )
    workdir: str = Field(..., description="folder on the shared filesystem every node sees, for run dirs")
    setup: str | None = Field(default=None, description="shell run on the node before each job (module load, venv)")
    python: str = Field(
        default="python3",
        description="interpreter on the nodes (after setup): with torch+deepspeed, or bootstrap's base",
    )
    runtime: Literal["none", "bootstrap"] = Field(
        default="none",
        description="none: python has the node side; bootstrap: `up` installs the pinned node side once, in a job "
        "on the partition, into <workdir>/venv over python (its torch when it is the pinned one)",
    )
    connect_timeout: float = Field(default=10, gt=0, le=600, description="seconds to wait for the login node")

    @property
    def ranks_per_node(self) -> int:
        return self.gpus_per_node or self.cpu_ranks

    @field_validator("partition", "account", "qos", "mem", "time", "constraint")
    @classmethod
    def _slurm_word(cls, value: str | None) -> str | None:
        if value is not None and not SLURM_WORD.match(value):
            raise ValueError(f"{value!r} is not a Slurm name (letters, digits and _.:,&|[]*=+-)")
        return value

    @field_validator("workdir")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/") or "\n" in value:
            raise ValueError("workdir must be an absolute path on the shared filesystem")
        return value.rstrip("/") or "/"

    @field_validator("login")
    @classmethod
    def _login(cls, value: str) -> str:
        match = HOST_RE.match(value)
        if value != "local" and (not match or (match["port"] and not 0 < int(match["port"]) < 65536)):
            raise ValueError(f"login {value!r} is not local, user@host[:port] or a Host alias")
        return value


Provider = Annotated[
    Union[LocalProvider, SSHProvider, VastProvider, RunPodProvider, AWSProvider, SlurmProvider],
    Field(discriminator="kind"),
]

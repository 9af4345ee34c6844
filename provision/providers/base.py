"""The provider interface: typed records at the boundary, no dicts of Any.

A provider turns config into a recorded cluster (`up`), hands out a Node per machine
(`nodes`), removes what it created (`down`, idempotent, verified against the provider's own
list), and tells the node how to delete itself (`self_teardown`) for teardown after-train.

What callers may rely on beyond that is declared, not probed with hasattr:
- `terminates_nodes`: `down` deletes the machines (cloud). Then a node that cannot be reached
  is no reason to stop: terminating it ends its runs anyway. False for machines gpuctl does
  not own (local, ssh), whose processes `down` must stop itself.
- `offers`: an OfferSource when the provider rents machines (`gpuctl offers`), else None.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from provision.core.config import GpuctlConfig
from provision.core.errors import ConfigError
from provision.core.provider_config import DEFAULT_IMAGE as DEFAULT_IMAGE  # one place: the package version
from provision.core.provider_config import CloudProvider
from provision.core.state import ClusterRecord, NodeRecord
from provision.transport.remote import Node

RUNTIMES = ("docker", "image", "bootstrap", "none")
IMAGE_PROVIDERS = ("vast", "runpod")  # the instance is created from the image
DOCKER_PROVIDERS = ("aws",)  # a VM with a Docker engine (the Deep Learning AMI has one)
IMAGE_PYTHON = "python"  # the image's venv python, first on its PATH
# What a node's start-up runs at every start of its container or machine (Vast: onstart; RunPod:
# images/entrypoint.sh; AWS: a cloud-init per-boot script): the budget guards' boot hook in the
# node's workdir ($GPUCTL_WORKDIR where provider.workdir is set, else $HOME/gpuctl), which starts
# each guard again that is not running (flows/guard.py). Nothing happens before `up` wrote one.
BOOT_HOOK = 'h="${GPUCTL_WORKDIR:-${HOME:-/root}/gpuctl}/guard/boot.sh"; if [ -f "$h" ]; then bash "$h"; fi'


def workdir_env(prov: CloudProvider) -> dict[str, str]:
    """The env a created instance gets for BOOT_HOOK: provider.workdir, where it is set."""
    return {"GPUCTL_WORKDIR": prov.workdir} if prov.workdir else {}


@dataclass
class UpOptions:
    dry_run: bool = False
    assume_yes: bool = False
    confirm: Callable[[str], bool] = lambda _question: True
    say: Callable[[str], None] = print
    doctor: bool = True  # run the quick checks (flows/doctor.py) once the cluster is up
    force: bool = False  # rent even when `gpuctl plan` says the config does not fit (estimate/fit.py)
    # A recovered run (flows/recover.py): hosts not to rent again, and what earlier clusters
    # of the run spent, which the budget cap counts too.
    exclude_hosts: set[str] = field(default_factory=set)
    spent_hours: float = 0.0
    spent_cost: float = 0.0


@dataclass
class SelfTeardown:
    """What the node runs after the run to delete itself; secrets travel in `env`, never argv.
    `check`: a read-only dry run of the same vendor calls with the same env (the key sees the
    instances, the endpoint answers from the node), which `up` runs at once; None: none to run."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    check: list[str] | None = None


@dataclass
class Offer:
    """One rentable machine shape at a price (per node)."""

    id: str  # what launch() needs: a vast ask id, a runpod cloud type, an EC2 instance type
    gpu_name: str
    num_gpus: int
    price_per_hour: float
    ram_gb: float | None = None
    disk_gb: float | None = None
    where: str = ""
    reliability: float | None = None
    spot: bool = False  # interruptible (RunPod spot, Vast bid): price_per_hour is the bid
    host: str = ""  # the vendor's machine (Vast machine_id), to avoid a host that lost a node
    download_mbps: float | None = None  # the host's measured download (Vast inet_down), for `up`'s estimate


class OfferSource(Protocol):
    """What a renting provider answers for `gpuctl offers` (and uses itself in `up`)."""

    def find_offers(self, prov: CloudProvider) -> list[Offer]:
        """Rentable machines matching the provider's filters, cheapest first."""

    def filters_text(self, prov: CloudProvider) -> str:
        """The filters in words, for titles and 'no offer matches ...' messages."""


class ProviderBackend(ABC):
    terminates_nodes: ClassVar[bool] = False

    @property
    def offers(self) -> OfferSource | None:
        return None

    @abstractmethod
    def up(self, cfg: GpuctlConfig, opts: UpOptions) -> ClusterRecord | None:
        """Create or connect the cluster; None on a dry run."""

    @abstractmethod
    def nodes(self, cluster: ClusterRecord) -> list[Node]:
        """One Node per machine, the first one first (it runs launch.sh)."""

    @abstractmethod
    def down(self, cluster: ClusterRecord, say: Callable[[str], None]) -> None:
        """Remove what `up` created; idempotent."""

    @abstractmethod
    def self_teardown(self, cluster: ClusterRecord) -> SelfTeardown | None:
        """What a node runs to delete itself (teardown after-train, budget cap); None: nothing to delete."""

    def node_teardown(self, cluster: ClusterRecord, node: NodeRecord) -> SelfTeardown | None:
        """What `node` runs to delete itself alone: every node of a capped cluster keeps a guard
        of its own that does it a little after the cap (flows/guard.py); None: nothing to delete."""
        return None

    def backstop(self, cluster: ClusterRecord, node: NodeRecord, minutes: int) -> list[str] | None:
        """A command `up` runs on each node of a capped cluster as a second line of defence behind
        the budget guard (flows/guard.py), ending the node `minutes` from now; None: none."""
        return None

    def undo_up(self, cluster: ClusterRecord, say: Callable[[str], None], failure: BaseException | None = None) -> bool:
        """`up` was interrupted (failure None) or failed after this backend returned: remove what it
        made. False when the cluster is kept instead (local, ssh: nothing of it is rented)."""
        return False


def resolve_runtime(
    requested: str, provider_kind: str, *, image: str | None = None, has_docker: Callable[[], bool] | None = None
) -> str:
    """The runtime to record for a cluster: none | docker | image | bootstrap.

    auto: Vast/RunPod -> image when provider.image is set, else bootstrap (a vendor PyTorch image,
    the node side installed at first boot: providers/bootstrap.py); AWS -> docker; ssh -> docker when an image is configured and
    the first node answers `docker version`, else none; local -> none.
    """
    if requested in ("image", "bootstrap") and provider_kind not in IMAGE_PROVIDERS:
        raise ConfigError(
            f"provider.runtime {requested} needs a provider that creates the node from an image "
            f"(vast, runpod), not {provider_kind}",
            "use runtime docker or none",
        )
    if requested == "image" and not image:
        raise ConfigError("provider.runtime image needs provider.image", "set provider.image, or runtime: bootstrap")
    if requested != "auto":
        if requested not in RUNTIMES:
            raise ConfigError(
                f"provider.runtime {requested!r} is not auto, docker, image, bootstrap or none", "fix provider.runtime"
            )
        return requested
    if provider_kind in IMAGE_PROVIDERS:
        return "image" if image else "bootstrap"
    if provider_kind in DOCKER_PROVIDERS:
        return "docker"
    if provider_kind == "ssh" and image and has_docker is not None and has_docker():
        return "docker"
    return "none"

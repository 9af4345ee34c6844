"""Where the launcher runs on a node, per provider and overridable (`provider.runtime`).

- `docker`: hosts with a Docker engine (ssh hosts, AWS). launch.sh stays on the host (it
  writes status.json, holds the process group); only the DeepSpeed launcher runs inside
  `docker run --rm ... IMAGE`, wrapped through BundleSpec.launcher_prefix.
- `image`: Vast.ai and RunPod create the instance from the image; the instance IS the
  container, so there is nothing to do at run time.
- `none`: the host's own Python (provider.python) with torch and DeepSpeed installed.

Secrets never reach the docker command line, the container's config or the image: the run dir
is mounted at the same path, and each rank reads its 0600 secrets.env there itself
(trainer/secrets_file.py). `-e NAME` (the name only: docker copies the value from launch.sh's
environment) carries the ranks' env; only non-secret values (paths) are written out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from provision.core.errors import ConfigError
from provision.providers.base import DEFAULT_IMAGE

if TYPE_CHECKING:
    from provision.core.config import GpuctlConfig
    from provision.core.state import ClusterRecord, RunRecord
    from provision.flows.render import BundleSpec
    from provision.transport.remote import Node

# Credentials the host itself may hold in its environment (the run's own arrive in secrets.env).
# A name the host does not have is not set in the container (docker's `-e NAME` semantics).
PASS_THROUGH = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_PROFILE",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "PYTHONUNBUFFERED",
)


@dataclass
class DockerRun:
    """`docker run` for one launcher; argv() goes in front of the launcher's own argv."""

    image: str
    run_dir: str
    name: str
    gpus: bool  # --gpus all; False on a node without GPUs (a CPU test node), where it would fail
    shm_size: str = "16g"
    ulimits: list[str] = field(default_factory=lambda: ["memlock=-1", "stack=67108864"])
    cache_dir: str | None = None  # host folder mounted at the same path (HF hub, torch extensions)
    mounts: list[str] = field(default_factory=list)  # extra -v SRC:DST[:ro]
    env_names: list[str] = field(default_factory=list)  # values from launch.sh's environment
    env_values: dict[str, str] = field(default_factory=dict)  # non-secret values (paths)
    extra_args: list[str] = field(default_factory=list)

    def argv(self) -> list[str]:
        argv = ["docker", "run", "--rm", "--init", "--name", self.name]
        if self.gpus:
            argv += ["--gpus", "all"]
        # ipc=host: NCCL and the dataloader need shared memory beyond docker's 64 MB default;
        # network host: ranks, the rendezvous port and pdsh see the node's real interfaces.
        argv += ["--ipc=host", "--network", "host", "--shm-size", self.shm_size]
        for limit in self.ulimits:
            argv += ["--ulimit", limit]
        argv += ["-v", f"{self.run_dir}:{self.run_dir}"]
        if self.cache_dir:
            argv += ["-v", f"{self.cache_dir}:{self.cache_dir}"]
        for mount in self.mounts:
            argv += ["-v", mount]
        argv += ["-w", self.run_dir]
        for name in self.env_names:
            argv += ["-e", name]
        for name, value in self.env_values.items():
            argv += ["-e", f"{name}={value}"]
        return [*argv, *self.extra_args, self.image]


def container_name(run_id: str) -> str:
    return f"gpuctl-{run_id}"


def remove_container(run: RunRecord, node: Node) -> None:
    """Force-remove a run's container (after its `docker run` client was killed); no-op otherwise."""
    from provision.core.state import find_cluster

    cluster = find_cluster(run.cluster)
    if cluster is not None and cluster.runtime == "docker":
        node.run(["docker", "rm", "-f", container_name(run.run_id)], check=False, timeout=120)


def docker_run_for(cfg: GpuctlConfig, cluster: ClusterRecord, spec: BundleSpec) -> DockerRun:
    """The DockerRun of a run: image from the cluster record, env names from the bundle spec.

    spec.secrets stay out of it: the ranks read them from the mounted run dir's secrets.env.
    """
    from provision.flows.render import rank_env

    if len(spec.nodes) > 1:
        raise ConfigError(
            "provider.runtime docker runs one node for now (multi-node needs sshd in "
            "the containers for DeepSpeed's pdsh launcher)",
            "use runtime none with the image's packages on the hosts, or one node",
        )
    docker = cfg.docker
    first = cluster.nodes[0]
    cache = f"{first.workdir.rstrip('/')}/cache"
    fixed = {
        "PYTHONPATH": f"{spec.run_dir}/lib:/opt/gpuctl",
        "HF_HOME": f"{cache}/huggingface",
        "TORCH_EXTENSIONS_DIR": f"{cache}/torch_extensions",
    }
    names = set(rank_env(cfg, spec)) | set(PASS_THROUGH)
    return DockerRun(
        image=cluster.image or DEFAULT_IMAGE,
        run_dir=spec.run_dir,
        name=container_name(spec.run_id),
        gpus=first.accelerator == "cuda",
        shm_size=docker.shm_size,
        ulimits=list(docker.ulimits),
        cache_dir=cache,
        mounts=list(docker.mounts),
        env_names=sorted(names - set(fixed)),
        env_values=fixed,
        extra_args=list(docker.run_args),
    )

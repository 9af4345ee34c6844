"""The trainer image on nodes that run it with docker: inspect, pull with a credential, ship.

Building it here is provision/flows/build.py; its build context is provision/flows/context.py.

How the image reaches a node (config `docker.ship`):
  pull   the node pulls from the registry; with GPUCTL_REGISTRY_USER and GPUCTL_REGISTRY_PASSWORD
         set, the credential goes on stdin into that one `docker pull`'s environment, where a
         throwaway credential helper in a temporary DOCKER_CONFIG hands it to docker: never argv,
         never the node's disk (`docker login` would keep it in ~/.docker/config.json), and the
         folder goes with the pull
  load   `docker save` here | SSH | `docker load` there, streamed, with a progress bar in bytes
  build  the build context (.dockerignore applied) streams as a tar into `docker build -` there
  auto   load when this machine has the image, else pull
A node that already has the image is skipped: same image ID as here (`docker image inspect
--format {{.Id}}` on both sides) for load, same context digest (an image label) for build.
The laptop's docker is whatever DOCKER_HOST / the default socket points at.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from provision.core.config import GpuctlConfig
from provision.core.errors import ConfigError, GpuctlError, RemoteError
from provision.core.provider_config import REGISTRY_PASSWORD_ENV, REGISTRY_USER_ENV, CloudProvider, SSHProvider
from provision.flows.context import build_context, context_tar
from provision.providers.base import DEFAULT_IMAGE
from provision.transport.remote import CommandResult, LocalNode, Node
from provision.transport.stream import pipe_into

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from provision.core.state import ClusterRecord

Say = Callable[[str], None]
USER_ENV, PASSWORD_ENV = REGISTRY_USER_ENV, REGISTRY_PASSWORD_ENV
DOCKER_HUB = "https://index.docker.io/v1/"  # the server name docker asks a credential helper for
CONTEXT_LABEL = "org.gpuctl.context-sha256"
CHUNK = 1 << 20  # bytes per read of a `docker save` stream or a context tar
DOCKER_FIX = "install Docker on the node and add the SSH user to the `docker` group"


@dataclass
class ShipResult:
    node: str
    action: str  # skipped | pulled | loaded | built
    image_id: str | None
    bytes_sent: int = 0
    seconds: float = 0.0


# --- inspecting -----------------------------------------------------------------------------


def image_id(node: Node, image: str) -> str | None:
    """The image's ID (sha256 of its config) on node, or None when it is not there."""
    result = _docker(node, ["image", "inspect", "--format", "{{.Id}}", image], check=False)
    return (result.stdout.strip() or None) if result.rc == 0 else None


def image_label(node: Node, image: str, label: str) -> str | None:
    fmt = "{{ index .Config.Labels " + f'"{label}"' + " }}"
    result = _docker(node, ["image", "inspect", "--format", fmt, image], check=False)
    value = result.stdout.strip()
    return value if result.rc == 0 and value not in ("", "<no value>") else None


def _docker(
    node: Node, args: list[str], *, check: bool = True, stdin: bytes | None = None, timeout: float | None = 300
) -> CommandResult:
    try:
        result = node.run(["docker", *args], check=False, stdin=stdin, timeout=timeout)
    except FileNotFoundError:
        raise GpuctlError("docker is not installed here", "install Docker (apt-get install docker.io)") from None
    return _check(node, args, result) if check else result


def _check(node: Node, args: list[str], result: CommandResult) -> CommandResult:
    if result.rc != 0:
        detail = (result.stderr.strip() or result.stdout.strip())[-300:]
        fix = DOCKER_FIX if "permission denied" in detail.lower() or result.rc == 127 else None
        raise RemoteError(f"{node.label}: docker {args[0]} failed: {detail}", fix)
    return result


# --- registry -------------------------------------------------------------------------------


def registry_of(image: str) -> str | None:
    """The registry host of an image reference; None for Docker Hub."""
    first, _, rest = image.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return first
    return None


def credentials() -> tuple[str, str] | None:
    user, password = os.environ.get(USER_ENV), os.environ.get(PASSWORD_ENV)
    return (user, password) if user and password else None


def login(node: Node, image: str) -> bool:
    """Log node's docker in to the image's registry when credentials are set. True if it did. Only for
    this machine's own engine (`image build --push`): a rented node's pull goes through pull()."""
    creds = credentials()
    if creds is None:
        return False
    registry = registry_of(image)
    argv = ["login", "--username", creds[0], "--password-stdin", *([registry] if registry else [])]
    _docker(node, argv, stdin=creds[1].encode(), timeout=120)
    return True


def logout(node: Node, image: str) -> None:
    registry = registry_of(image)
    _docker(node, ["logout", *([registry] if registry else [])], check=False, timeout=60)


# `docker pull IMAGE` with the registry credential (one JSON line on stdin) in docker's environment only:
# DOCKER_CONFIG names a fresh 0700 folder whose config sends every registry to the helper beside it,
# which prints the credential from the environment docker hands it. Nothing there holds the secret,
# and the folder goes when the shell ends. (docker pull runs no login: a refused credential is the pull's error.)
PULL_SCRIPT = r"""set -u
dir=$(mktemp -d "${TMPDIR:-/tmp}/gpuctl-pull.XXXXXX") || exit 1
trap 'rm -rf -- "$dir"' EXIT
trap 'exit 129' HUP INT TERM
IFS= read -r auth
echo '{"credsStore": "gpuctl-once"}' > "$dir/config.json"
cat > "$dir/docker-credential-gpuctl-once" <<'HELPER'
#!/bin/sh
case "$1" in
  get) cat >/dev/null; printf '%s\n' "$GPUCTL_REGISTRY_AUTH" ;;
  list) echo '{}' ;;
esac
HELPER
chmod 700 "$dir/docker-credential-gpuctl-once"
GPUCTL_REGISTRY_AUTH=$auth DOCKER_CONFIG=$dir PATH="$dir:$PATH" docker pull --quiet "$1"
"""


def pull(node: Node, image: str) -> None:
    """docker pull on node; with registry credentials set, through PULL_SCRIPT (see there)."""
    creds = credentials()
    if creds is None:
        _docker(node, ["pull", "--quiet", image], timeout=3600)
        return
    auth = json.dumps({"ServerURL": registry_of(image) or DOCKER_HUB, "Username": creds[0], "Secret": creds[1]})
    result = node.run(
        ["bash", "-c", PULL_SCRIPT, "gpuctl-pull", image], check=False, stdin=f"{auth}\n".encode(), timeout=3600
    )
    _check(node, ["pull"], result)


# --- naming --------------------------------------------------------------------------------


def image_name(cfg: GpuctlConfig, cluster: ClusterRecord | None = None) -> str:
    if cluster is not None and cluster.image:
        return cluster.image
    prov = cfg.provider
    configured = prov.image if isinstance(prov, (SSHProvider, CloudProvider)) else None
    return configured or DEFAULT_IMAGE


# --- shipping -------------------------------------------------------------------------------


def ship(
    node: Node, image: str, how: str, *, cfg: GpuctlConfig | None = None, say: Say = print, progress: bool = True
) -> ShipResult:
    """Make node have image; skip when it already has the same one. See the module docstring."""
    started = time.monotonic()
    local_id = _local_id(image, required=how == "load") if how in ("auto", "load") else None
    if how == "auto":
        how = "load" if local_id else "pull"
    if how == "load":
        if local_id is None:
            raise GpuctlError(
                f"{image} is not in this machine's docker engine",
                "run `gpuctl image build` first, or set docker.ship: pull",
            )
        if image_id(node, image) == local_id:
            say(f"{node.label}: has {image} ({local_id[:19]}), skipping the transfer")
            return ShipResult(node.label, "skipped", local_id)
        sent = _load(node, image, say, progress)
        remote_id = image_id(node, image)
        if remote_id != local_id:
            raise RemoteError(f"{node.label}: docker load gave {remote_id}, expected {local_id}")
        return ShipResult(node.label, "loaded", remote_id, sent, time.monotonic() - started)
    if how == "build":
        if cfg is None:
            raise ConfigError("ship: build needs the config's docker.context")
        return _build_on(node, image, cfg, say, progress, started)
    if how == "pull":
        say(f"{node.label}: docker pull {image}")
        try:
            pull(node, image)
        except RemoteError as exc:
            have = image_id(node, image)
            if have is None:
                raise
            say(f"warning: {exc.message}; using the copy {node.label} already has ({have[:19]})")
            return ShipResult(node.label, "skipped", have)
        return ShipResult(node.label, "pulled", image_id(node, image), 0, time.monotonic() - started)
    raise ConfigError(f"docker.ship {how!r} is not auto, pull, load or build")


def _local_id(image: str, *, required: bool) -> str | None:
    """The image's ID in this machine's engine; None without one (unless required: then raise)."""
    try:
        return image_id(LocalNode(), image)
    except GpuctlError:
        if required:
            raise
        return None  # no docker here at all: `auto` pulls on the node


def ship_cluster(
    cfg: GpuctlConfig,
    cluster: ClusterRecord,
    say: Say = print,
    nodes: list[Node] | None = None,
    how: str | None = None,
) -> list[ShipResult]:
    """Ship the cluster's image to every node (no-op unless its runtime is docker)."""
    if cluster.runtime != "docker":
        return []
    from provision.providers import backend

    own = nodes is None
    if nodes is None:
        nodes = backend(cluster.provider).nodes(cluster)
    try:
        return [ship(node, image_name(cfg, cluster), how or cfg.docker.ship, cfg=cfg, say=say) for node in nodes]
    finally:
        if own:
            for node in nodes:
                node.close()


def _progress(total: int | None, what: str) -> tuple[Progress, TaskID]:
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    )
    return bar, bar.add_task(what, total=total)


def _stream(
    chunks: Iterator[bytes], node: Node, argv: list[str], total: int | None, what: str, progress: bool
) -> tuple[int, str]:
    sent = 0

    shown = _progress(total, what) if progress else None

    def count(n: int) -> None:
        nonlocal sent
        sent += n
        if shown is not None:
            bar, task = shown
            bar.update(task, completed=sent)

    if shown is not None:
        shown[0].start()
    try:
        result = pipe_into(node, argv, chunks, on_bytes=count)
    finally:
        if shown is not None:
            bar, task = shown
            bar.update(task, total=sent, completed=sent)
            bar.stop()
    return sent, result.stdout


def _load(node: Node, image: str, say: Say, progress: bool) -> int:
    size = _docker(LocalNode(), ["image", "inspect", "--format", "{{.Size}}", image]).stdout.strip()
    say(f"{node.label}: sending {image} (docker save | docker load)")
    proc = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdout, stderr = proc.stdout, proc.stderr
    assert stdout is not None and stderr is not None  # both PIPE

    def chunks() -> Iterator[bytes]:
        while data := stdout.read(CHUNK):
            yield data

    try:
        sent, _ = _stream(
            chunks(),
            node,
            ["docker", "load"],
            int(size) if size.isdigit() else None,
            f"{image} -> {node.label}",
            progress,
        )
    finally:
        stdout.close()
        err = stderr.read().decode(errors="replace")
        rc = proc.wait()
    if rc != 0:
        raise GpuctlError(f"docker save {image} failed: {err.strip()[-300:]}")
    return sent


def _build_on(node: Node, image: str, cfg: GpuctlConfig, say: Say, progress: bool, started: float) -> ShipResult:
    context, dockerfile = build_context(cfg)
    with tempfile.TemporaryFile() as tar:
        digest = context_tar(context, dockerfile, tar)
        if image_label(node, image, CONTEXT_LABEL) == digest:
            say(f"{node.label}: has {image} built from this context ({digest[:12]}), skipping the build")
            return ShipResult(node.label, "skipped", image_id(node, image))
        size = tar.tell()
        tar.seek(0)
        say(f"{node.label}: building {image} there from {context} ({size} bytes of context)")
        argv = ["docker", "build", "-t", image, "--label", f"{CONTEXT_LABEL}={digest}", "-f", dockerfile, "-"]
        sent, _ = _stream(iter(lambda: tar.read(CHUNK), b""), node, argv, size, f"context -> {node.label}", progress)
    return ShipResult(node.label, "built", image_id(node, image), sent, time.monotonic() - started)

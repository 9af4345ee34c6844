"""Building the trainer image here: one Dockerfile, two flavours, `docker build` with its output.

A flavour is a set of build args for the same Dockerfile; every step but the base image, the
torch wheel source and DeepSpeed's accelerator is shared, so building `cpu` (which needs no GPU
and no registry) runs the steps `cuda` runs:
  cuda  the Dockerfile's defaults: CUDA 12.8 + cuDNN base, CUDA torch from PyPI, DeepSpeed's CPU
        Adam and fused Adam prebuilt for sm_80/89/90. What Vast.ai and RunPod boot.
  cpu   a Debian base, torch's CPU build (PyTorch's own index), CPU Adam and the shared-memory
        allreduce prebuilt, DS_ACCELERATOR=cpu. What the tests build and run (with
        images/make-base.sh's debootstrap base in place of a pulled Debian image).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from provision.core.config import GpuctlConfig
from provision.core.errors import ConfigError, GpuctlError
from provision.flows.context import build_context
from provision.flows.image import image_id, login, logout
from provision.transport.remote import LocalNode

Say = Callable[[str], None]
FLAVOURS: dict[str, dict[str, str]] = {
    "cuda": {},  # the Dockerfile's defaults
    "cpu": {
        "BASE_IMAGE": "debian:bookworm-slim",
        "FLAVOUR": "cpu",
        "TORCH_INDEX_URL": "https://download.pytorch.org/whl/cpu",
        "DS_ACCELERATOR": "cpu",
        "PREBUILD_OPS": "CPU_ADAM SHM_COMM",
    },
}
MAX_CA_BYTES = 64 * 1024  # build args travel in the request URL: a few certificates, not a system bundle


@dataclass
class BuildOptions:
    flavour: str = "cuda"
    base: str | None = None  # BASE_IMAGE instead of the flavour's (e.g. images/make-base.sh's output)
    torch_index_url: str | None = None  # where the flavour's torch wheel is, instead of its default
    network: str | None = None  # docker build --network: `host` for an engine without a bridge
    ca_certs: Path | None = None  # PEM file: extra CAs for pip behind a TLS-intercepting proxy
    push: bool = False
    no_cache: bool = False  # docker build --no-cache: every step runs (a cold build's timing)
    extra_args: dict[str, str] = field(default_factory=dict)


@dataclass
class Built:
    image: str
    image_id: str
    seconds: float
    cached_steps: int  # steps docker answered from its layer cache
    steps: int


def build_args(opts: BuildOptions, context: Path) -> dict[str, str]:
    """The --build-arg values for opts: the flavour's, then the overrides, then gpuctl's own."""
    if opts.flavour not in FLAVOURS:
        raise ConfigError(
            f"image flavour {opts.flavour!r} is not one of {', '.join(FLAVOURS)}", "use --flavour cpu or cuda"
        )
    args = dict(FLAVOURS[opts.flavour])
    if opts.base:
        args["BASE_IMAGE"] = opts.base
    if opts.torch_index_url:
        args["TORCH_INDEX_URL"] = opts.torch_index_url
    if opts.ca_certs:
        args["BUILD_CA_CERTS"] = _read_ca(opts.ca_certs)
    from provision import __version__ as version

    args.update(VCS_REF=_revision(context), GPUCTL_VERSION=version, **opts.extra_args)
    return args


def build(cfg: GpuctlConfig, image: str, opts: BuildOptions | None = None, *, say: Say = print) -> Built:
    """`docker build` here with the context as is; optionally push. What was built, and how fast."""
    opts = opts or BuildOptions()
    context, dockerfile = build_context(cfg)
    argv = ["docker", "build", "-t", image, "-f", str(context / dockerfile)]
    if opts.network:
        argv += ["--network", opts.network]
    if opts.no_cache:
        argv.append("--no-cache")
    for name, value in build_args(opts, context).items():
        argv += ["--build-arg", f"{name}={value}"]
    started = time.monotonic()
    lines = _run_here([*argv, str(context)], say)
    seconds = time.monotonic() - started
    if opts.push:
        here = LocalNode()
        logged_in = login(here, image)
        try:
            _run_here(["docker", "push", image], say)
        finally:
            if logged_in:
                logout(here, image)
    found = image_id(LocalNode(), image)
    if not found:
        raise GpuctlError(f"docker build finished but {image} is not in the local engine")
    steps = sum(1 for line in lines if line.startswith("Step "))
    cached = sum(1 for line in lines if line.strip() == "---> Using cache")
    return Built(image, found, seconds, cached, steps)


def _revision(context: Path) -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(context), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"  # no git here
    return out.stdout.strip() or "unknown"  # not a checkout


def _read_ca(path: Path) -> str:
    try:
        text = path.expanduser().read_text()
    except OSError as exc:
        raise ConfigError(f"--ca-certs {path}: {exc.strerror}", "give a PEM file of CA certificates") from None
    if "-----BEGIN CERTIFICATE-----" not in text or len(text) > MAX_CA_BYTES:
        raise ConfigError(
            f"--ca-certs {path}: not a PEM file of at most {MAX_CA_BYTES // 1024} KB",
            "give only the extra CA certificates (e.g. /usr/local/share/ca-certificates/*.crt), not a system bundle",
        )
    return text.strip()


def _run_here(argv: list[str], say: Say) -> list[str]:
    """Run a local docker command, its output (stdout and stderr) line by line to say; the lines."""
    try:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL
        )
    except FileNotFoundError:
        raise GpuctlError("docker is not installed here", "install Docker (apt-get install docker.io)") from None
    assert proc.stdout is not None  # stdout=PIPE
    lines: list[str] = []
    for line in proc.stdout:
        say(line.rstrip("\n"))
        lines.append(line.rstrip("\n"))
    if proc.wait() != 0:
        tail = [line.strip() for line in lines[-5:]]
        raise GpuctlError(f"{' '.join(argv[:2])} failed (exit {proc.returncode}): {' | '.join(tail)[-300:]}")
    return lines

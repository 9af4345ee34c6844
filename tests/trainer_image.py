"""The real trainer image (cpu flavour) for tests: built once per session, cached between runs.

What goes into it, all from this machine or the package registries, no image registry:
- an engine of its own (tests/dockerd.py's Dockerd) whose --data-root stays in the cache dir
  ($GPUCTL_CACHE_DIR, else ${XDG_CACHE_HOME:-~/.cache}/gpuctl; dockerd/), so docker's layer cache
  outlives the session and an unchanged image rebuilds in seconds. overlay2 where the kernel
  mounts it (vfs copies the whole 2 GB tree for every build step and container), else vfs. A
  file lock keeps two sessions off one data root; an engine a killed session left is stopped.
- the base: images/make-base.sh (debootstrap, its tar cached by its inputs)
- torch's CPU wheel: `pip download` with this machine's pip configuration (it may reach a mirror
  or find-links where download.pytorch.org is out of reach), served on loopback as a one-package
  index and handed to the build as TORCH_INDEX_URL ($GPUCTL_TORCH_INDEX_URL skips all that)
- the CA certificates this machine trusts beyond the public ones (a TLS-intercepting proxy), for
  the build's pip (`--ca-certs`)
- `gpuctl image build --flavour cpu --base ... --network host` semantics (the engine has no bridge)

Fixtures (registered by tests/conftest.py's ``pytest_plugins``): ``image_engine`` and
``trainer_image``, both per session.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import http.server
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.dockerd import Dockerd
from tests.helpers import REPO

IMAGE = "gpuctl-trainer:cpu-test"
BASE_PYTHON = "311"  # python3 of images/make-base.sh's suite (Debian bookworm): the wheel's tag
LOCK_WAIT_S = 1800  # another session building the image: wait for it rather than fail
# The index URL is a build arg of the torch step, so part of its cache key: serve it on the same
# port every session (the engine lock keeps sessions apart; below the ephemeral range). If the
# port is taken, a random one works too, at the price of rebuilding from the torch layer on.
INDEX_PORT = 18919


def cache_dir() -> Path:
    base = (
        os.environ.get("GPUCTL_CACHE_DIR")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpuctl"
    )
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path


def overlay_works() -> bool:
    """Can this kernel mount overlayfs here (docker's overlay2 needs it)?"""
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        parts = [Path(tmp, p) for p in ("lower", "upper", "work", "merged")]
        for part in parts:
            part.mkdir()
        opts = f"lowerdir={parts[0]},upperdir={parts[1]},workdir={parts[2]}"
        mounted = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(parts[3])], capture_output=True)
        if mounted.returncode == 0:
            subprocess.run(["umount", str(parts[3])], capture_output=True)
        return mounted.returncode == 0


def _stop_orphan(pidfile: Path, data_root: Path) -> None:
    """A dockerd a killed session left on this data root (we hold the lock: nobody else uses it)."""
    try:
        pid = int(pidfile.read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return
    root = str(data_root).encode()  # its --data-root is a driver folder below data_root
    if cmdline and cmdline[0].endswith(b"dockerd") and any(arg.startswith(root) for arg in cmdline):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.2)


@contextlib.contextmanager
def locked_engine() -> Iterator[Dockerd]:
    """The image engine on the persistent data root, this process holding its lock."""
    cache = cache_dir()
    with open(cache / "dockerd.lock", "w") as lock:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{cache}/dockerd.lock held for {LOCK_WAIT_S} s by another session") from None
                time.sleep(2)
        data_root = cache / "dockerd"
        _stop_orphan(cache / "dockerd.pid", data_root)
        driver = "overlay2" if overlay_works() else "vfs"
        root = Path(tempfile.mkdtemp(prefix="gpuctl-img-", dir="/tmp"))
        engine = Dockerd(root, data_root=data_root / driver, storage_driver=driver).start()
        (cache / "dockerd.pid").write_text(str(engine.proc.pid if engine.proc else ""))
        for stale in engine.docker("ps", "-aq").stdout.decode().split():  # a killed session's containers
            engine.docker("rm", "-f", stale, check=False)
        try:
            yield engine
        finally:
            engine.stop()
            (cache / "dockerd.pid").unlink(missing_ok=True)


@pytest.fixture(scope="session")
def image_engine() -> Iterator[Dockerd]:
    with locked_engine() as engine:
        yield engine


# --- what the build needs -----------------------------------------------------------------------


def make_base(engine: Dockerd) -> str:
    out = subprocess.run(
        ["bash", str(REPO / "images" / "make-base.sh")],
        env={**engine.env, "GPUCTL_CACHE_DIR": str(cache_dir())},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert out.returncode == 0, f"images/make-base.sh failed:\n{out.stderr[-3000:]}"
    return out.stdout.strip().splitlines()[-1]


def torch_pin() -> str:
    text = (REPO / "images" / "requirements-torch-cpu.txt").read_text()
    return re.search(r"^torch==(\S+)$", text, re.M)[1]


def torch_wheel() -> Path:
    """The cpu flavour's torch wheel, fetched once into the cache with this machine's pip setup."""
    wheels = cache_dir() / "wheels"
    wheels.mkdir(exist_ok=True)
    version = torch_pin()
    tag = f"cp{BASE_PYTHON}"
    found = sorted(wheels.glob(f"torch-{version.replace('+', '?')}-{tag}-*.whl"))
    if not found:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--python-version",
                BASE_PYTHON,
                "--dest",
                str(wheels),
                f"torch=={version}",
            ],
            capture_output=True,
            text=True,
            timeout=1200,
        )
        assert out.returncode == 0, f"pip could not fetch torch=={version}:\n{out.stderr[-2000:]}"
        found = sorted(wheels.glob(f"torch-{version.replace('+', '?')}-{tag}-*.whl"))
    assert found, f"no torch {version} wheel for {tag} in {wheels}"
    return found[-1]


@contextlib.contextmanager
def wheel_index(wheel: Path) -> Iterator[str]:
    """A PEP 503 index on loopback with one project, torch, holding `wheel`; yields its URL."""
    root = Path(tempfile.mkdtemp(prefix="gpuctl-index-"))
    (root / "torch").mkdir()
    (root / "torch" / wheel.name).symlink_to(wheel)
    link = urllib.parse.quote(wheel.name)
    (root / "torch" / "index.html").write_text(f'<a href="{link}">{wheel.name}</a>\n')

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(root))
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", INDEX_PORT), handler)
    except OSError:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        shutil.rmtree(root, ignore_errors=True)


def _pem_blocks(text: str) -> dict[str, str]:
    blocks = re.findall(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", text, re.S)
    return {"".join(block.split()[2:-2]): block for block in blocks}  # keyed by the base64 body


def extra_ca_certs() -> str:
    """PEM of the CAs this machine trusts beyond the distribution's own store ("" when there are
    none): what a TLS-intercepting proxy needs. The distribution's store is /usr/share/ca-certificates;
    local additions (/usr/local/share/ca-certificates, update-ca-certificates) remain. Not compared with
    certifi's bundle: a machine behind such a proxy often has its CA patched into the venv's certifi
    too, and the build's pip has a certifi of its own without it."""
    mine = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE") or ssl.get_default_verify_paths().cafile
    if not mine or not Path(mine).is_file():
        return ""
    known: set[str] = set()
    for crt in Path("/usr/share/ca-certificates").rglob("*.crt"):
        known |= set(_pem_blocks(crt.read_text(errors="replace")))
    return "\n".join(pem for body, pem in _pem_blocks(Path(mine).read_text()).items() if body not in known)


# --- the image ----------------------------------------------------------------------------------


@dataclass
class TrainerImage:
    name: str
    image_id: str
    base: str
    engine: Dockerd
    seconds: float  # this session's build (seconds when the layer cache had everything)
    cached_steps: int
    steps: int

    def run(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        """docker run --rm --network host IMAGE ARGS... (the engine has no bridge)."""
        return self.engine.docker("run", "--rm", "--network", "host", self.name, *args, check=check, timeout=timeout)


def build_cpu_image(
    engine: Dockerd, name: str, context: Path | None = None, say=lambda _line: None, no_cache: bool = False
):
    """`gpuctl image build --flavour cpu` into engine, from context (default: this source tree)."""
    from provision.core.config import GpuctlConfig
    from provision.flows import build

    base = make_base(engine)
    cfg = GpuctlConfig.model_validate({"docker": {"context": str(context)}} if context else {})
    with contextlib.ExitStack() as stack:
        index = os.environ.get("GPUCTL_TORCH_INDEX_URL") or stack.enter_context(wheel_index(torch_wheel()))
        ca_file = None
        if pem := extra_ca_certs():
            ca_file = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "ca.pem"
            ca_file.write_text(pem + "\n")
        patch = stack.enter_context(pytest.MonkeyPatch.context())
        patch.setenv("DOCKER_HOST", engine.host)
        opts = build.BuildOptions(
            flavour="cpu", base=base, torch_index_url=index, network="host", ca_certs=ca_file, no_cache=no_cache
        )
        built = build.build(cfg, name, opts, say=say)
    engine.docker("image", "prune", "-f", check=False)  # what an earlier build of the tag left behind
    return base, built


@pytest.fixture(scope="session")
def trainer_image(image_engine) -> TrainerImage:
    log = cache_dir() / "trainer-image-build.log"
    started = time.monotonic()
    with open(log, "w") as out:
        base, built = build_cpu_image(image_engine, IMAGE, say=lambda line: print(line, file=out, flush=True))
    if phases := os.environ.get("GPUCTL_TEST_PHASES"):  # tests/run.sh prints it beside its own phases
        with open(phases, "a") as out:
            print(f"{'  image build (in pytest)':<26}{time.monotonic() - started:5.0f}s", file=out)
    return TrainerImage(IMAGE, built.image_id, base, image_engine, built.seconds, built.cached_steps, built.steps)

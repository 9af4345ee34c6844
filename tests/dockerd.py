"""Real Docker engines for tests: apt's docker.io dockerd, one per "machine", no registry.

``Dockerd(root).start()`` runs ``dockerd --storage-driver=vfs --bridge=none --iptables=false
--ip6tables=false`` with its own --data-root, --exec-root, --pidfile and a unix socket
``-H unix://ROOT/docker.sock`` (its own containerd under the exec root), so several engines
run side by side without touching a system one. vfs needs no overlayfs and --bridge=none no
iptables/netns; containers therefore use ``--network host`` (what gpuctl's runtime docker
does anyway). Clients pick an engine with DOCKER_HOST (``.env``). Needs root.

No registry is reachable, so the test image comes from a rootfs: ``minimal_rootfs(tar)``
writes bash, a few coreutils and Debian's /usr/bin/python3 (stdlib minus tests/GUI, ~25 MB)
with the shared libraries ldd names, and ``docker import`` turns it into an image in about
a second. That is faster and needs no network, unlike debootstrap or a pulled base image.

Fixtures (registered by tests/conftest.py's ``pytest_plugins``; ask for them by name): two
engines per test session, ``laptop_docker`` and ``node_docker``; ``rootfs_tar`` is imported into
both as ``BASE_IMAGE``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from pathlib import Path

import pytest

DOCKERD = shutil.which("dockerd") or "/usr/sbin/dockerd"
BASE_IMAGE = "gpuctl-test-base:1"
TOOLS = (
    "bash",
    "cat",
    "ls",
    "mkdir",
    "rm",
    "mv",
    "cp",
    "sleep",
    "date",
    "env",
    "id",
    "uname",
    "head",
    "tail",
    "tr",
    "true",
    "false",
    "echo",
    "sha256sum",
    "hostname",
    "ps",
)
STDLIB_SKIP = {
    "test",
    "idlelib",
    "tkinter",
    "turtledemo",
    "ensurepip",
    "lib2to3",
    "pydoc_data",
    "__pycache__",
    "site-packages",
    "dist-packages",
    "unittest",
    "distutils",
}


class Dockerd:
    """One engine. ``root`` holds its socket and runtime state and is deleted by stop();
    ``data_root`` (images, layers, build cache) defaults to root/data, and may live elsewhere to
    outlast the engine (tests/trainer_image.py keeps the image's layer cache between runs)."""

    def __init__(self, root: Path, *, data_root: Path | None = None, storage_driver: str = "vfs"):
        if os.geteuid() != 0 or not os.path.exists(DOCKERD):
            pytest.skip("needs root and dockerd (apt-get install docker.io)")
        self.root = root
        self.data_root = data_root or root / "data"
        self.storage_driver = storage_driver
        self.socket = root / "docker.sock"  # unix socket paths must stay under 108 bytes
        self.host = f"unix://{self.socket}"
        self.log = root / "dockerd.log"
        self.proc: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": self.host}

    def start(self, timeout: float = 60) -> Dockerd:
        argv = [
            DOCKERD,
            f"--storage-driver={self.storage_driver}",
            "--bridge=none",
            "--iptables=false",
            "--ip6tables=false",
            "--data-root",
            str(self.data_root),
            "--exec-root",
            str(self.root / "exec"),
            "--pidfile",
            str(self.root / "dockerd.pid"),
            "-H",
            self.host,
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dockerd exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            if self.socket.exists() and self.docker("version", check=False).returncode == 0:
                return self
            time.sleep(0.2)
        raise RuntimeError(f"dockerd did not answer within {timeout}s: {self.log.read_text()[-2000:]}")

    def docker(
        self, *args: str, check: bool = True, input: bytes | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess:
        result = subprocess.run(["docker", *args], env=self.env, capture_output=True, input=input, timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)}: {result.stderr.decode()[-2000:]}")
        return result

    def image_id(self, image: str) -> str | None:
        out = self.docker("image", "inspect", "--format", "{{.Id}}", image, check=False)
        return out.stdout.decode().strip() or None if out.returncode == 0 else None

    def stop(self) -> None:
        if self.proc is None:
            return
        for container in self.docker("ps", "-aq", check=False).stdout.decode().split():
            self.docker("rm", "-f", container, check=False)
        self.proc.send_signal(signal.SIGTERM)  # dockerd stops its containerd itself
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None
        # dockerd leaves its default netns bind-mounted under the exec root (and overlay mounts
        # of crashed containers under the data root): unmount, then delete
        prefixes = (f"{self.root}/", f"{self.data_root}/")
        with open("/proc/mounts") as fh:
            mounts = [line.split()[1] for line in fh if line.split()[1].startswith(prefixes)]
        for mount in sorted(mounts, reverse=True):
            subprocess.run(["umount", "-l", mount], capture_output=True, timeout=30)
        shutil.rmtree(self.root, ignore_errors=True)


def _ldd(path: str) -> set[str]:
    out = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
    libs = set()
    for line in out.splitlines():
        parts = line.split()
        if "=>" in parts and len(parts) > parts.index("=>") + 1 and parts[parts.index("=>") + 1].startswith("/"):
            libs.add(parts[parts.index("=>") + 1])
        elif parts and parts[0].startswith("/"):
            libs.add(parts[0])  # the dynamic loader
    return libs


def host_python() -> tuple[str, Path]:
    """(interpreter, its stdlib): Debian's /usr/bin/python3 when there, else the one running pytest."""
    if os.path.exists("/usr/bin/python3"):
        real = os.path.realpath("/usr/bin/python3")
        out = subprocess.run(
            [real, "-c", "import sysconfig; print(sysconfig.get_paths()['stdlib'])"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        return real, Path(out.stdout.strip())
    return os.path.realpath(sys._base_executable), Path(sysconfig.get_paths()["stdlib"])


def minimal_rootfs(out: Path) -> Path:
    """A tar of a tiny root filesystem: bash, coreutils, python3 (+stdlib), their libraries."""
    python, stdlib = host_python()
    binaries = [shutil.which(t, path="/usr/bin:/bin") for t in TOOLS]
    binaries = [b for b in binaries if b] + [python]
    libs: set[str] = set()
    for binary in binaries + [str(p) for p in (stdlib / "lib-dynload").glob("*.so")]:
        libs |= _ldd(binary)

    def skip(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        parts = Path(info.name).parts
        return None if set(parts) & STDLIB_SKIP or any(p.startswith("config-") for p in parts) else info

    with tarfile.open(out, "w") as tar:
        for folder in ("tmp", "root", "etc", "usr/bin", "opt", "workspace", "dev", "proc", "sys"):
            info = tarfile.TarInfo(folder)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if folder == "tmp" else 0o755
            tar.addfile(info)
        # merged /usr, as Debian has it: /bin, /lib, /lib64 are links into /usr
        files = {
            ("usr" + p if p.startswith(("/bin/", "/lib/", "/lib64/")) else p.lstrip("/")): p
            for p in set(binaries) | libs
        }
        for arcname, path in sorted(files.items()):
            tar.add(os.path.realpath(path), arcname=arcname)
        tar.add(str(stdlib), arcname=str(stdlib).lstrip("/"), filter=skip)
        if Path("/etc", stdlib.name).is_dir():  # Debian's sitecustomize lives there
            tar.add(f"/etc/{stdlib.name}", arcname=f"etc/{stdlib.name}")
        links = [("usr/bin/sh", "bash"), ("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64")]
        links += [(f"usr/bin/{name}", python) for name in ("python3", "python") if python != f"/usr/bin/{name}"]
        for name, target in links:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
        passwd = b"root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
        for name, data in (("etc/passwd", passwd), ("etc/group", b"root:x:0:\nnogroup:x:65534:\n")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, fileobj=__import__("io").BytesIO(data))
    return out


def import_base(daemon: Dockerd, rootfs: Path, name: str = BASE_IMAGE) -> str:
    daemon.docker(
        "import",
        "--change",
        "ENV PATH=/usr/local/bin:/usr/bin:/bin",
        "--change",
        "WORKDIR /workspace",
        str(rootfs),
        name,
    )
    return daemon.image_id(name)


def _engine(prefix: str) -> Dockerd:
    return Dockerd(Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))).start()


@pytest.fixture(scope="session")
def rootfs_tar(tmp_path_factory) -> Path:
    return minimal_rootfs(tmp_path_factory.mktemp("rootfs") / "rootfs.tar")


@pytest.fixture(scope="session")
def laptop_docker(rootfs_tar) -> Dockerd:
    daemon = _engine("gpuctl-laptop-")
    import_base(daemon, rootfs_tar)
    yield daemon
    daemon.stop()


@pytest.fixture(scope="session")
def node_docker(rootfs_tar) -> Dockerd:
    daemon = _engine("gpuctl-node-")
    import_base(daemon, rootfs_tar)
    yield daemon
    daemon.stop()

"""Helpers for the cloud-provider tests: a project config for a fake cloud whose "instance" is the
loopback test sshd, and a scan for leaked secrets (gpuctl as a subprocess: tests/helpers.py and
the ``gpuctl`` fixture)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.fakes.base import SshTarget
from tests.helpers import GPUCTL, REPO


def ssh_target(sshd) -> SshTarget:
    return SshTarget(address="127.0.0.1", port=sshd.port, authorized_keys=sshd.authorized_keys, user=sshd.user)


def serve_vast(sshd, monkeypatch, **fields) -> Iterator[Any]:
    """A test's `fake` fixture for Vast.ai (`yield from serve_vast(sshd, monkeypatch)`): the fake
    serving, its instances the loopback sshd, gpuctl's key env set, cloud polls quick."""
    from tests.fakes.vast_api import FakeVast

    yield from _serve(FakeVast(ssh=ssh_target(sshd), **fields), "VAST_API_KEY", monkeypatch)


def serve_runpod(sshd, monkeypatch, **fields) -> Iterator[Any]:
    """The same for RunPod's GraphQL API."""
    from tests.fakes.runpod_api import FakeRunPod

    yield from _serve(FakeRunPod(ssh=ssh_target(sshd), **fields), "RUNPOD_API_KEY", monkeypatch)


def _serve(fake, key_env: str, monkeypatch) -> Iterator[Any]:
    from provision.providers import cloud

    with fake as server:
        monkeypatch.setenv(key_env, server.key)
        monkeypatch.setattr(cloud, "POLL_S", 0.2)
        yield server


def node_fields(tmp: Path, ranks: int = 3) -> dict:
    """Provider fields that make the loopback sshd a usable node: this venv's python, a scratch
    workdir, and CPU ranks (the stand-in has no GPU: its nvidia-smi is absent). The stand-in is a
    node booted from the prebuilt trainer image (this venv has the node side): `image` is set, so
    runtime auto is `image`, not bootstrap (tests/test_bootstrap.py covers that)."""
    from provision.core.provider_config import DEFAULT_IMAGE

    return {
        "python": sys.executable,
        "workdir": str(tmp / "node"),
        "cpu_ranks_fallback": ranks,
        "ready_timeout": 120,
        "image": DEFAULT_IMAGE,
    }


def saved_run(cluster: str, run_id: str, *, pgid: int = 999999, run_dir: str = "/nowhere") -> Any:
    """A run recorded as running on the cluster (4 steps of batch 12 on 3 ranks), saved in the state
    dir: what `down`, `status` and recovery find without a training run behind it. pgid: the
    process group a `cancel` signals (999999: none)."""
    from provision.core import state

    run = state.RunRecord(
        run_id=run_id,
        cluster=cluster,
        run_dir=run_dir,
        bundle_dir="/nowhere",
        world_size=3,
        train_batch_size=12,
        micro_batch=1,
        grad_accum=4,
        max_steps=4,
        state="running",
        pgid=pgid,
    )
    state.save_run(run)
    return run


def write_config(project: Path, provider: dict, *, name: str, teardown: str = "never", **train) -> Path:
    """teardown: written out (a renting provider's default is after-train). storage: a path with
    node_local, as the stand-in node is this machine, so its disk is the laptop's."""
    cfg = {
        "name": name,
        "provider": provider,
        "teardown": teardown,
        "storage": {"node_local": True},
        "train": {"max_steps": 4, "checkpoint_every": 0, "log_every": 1, **train},
        # the node's launch.sh does not inherit the test's env: share DeepSpeed's op cache explicitly
        "env": {
            "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
        },
    }
    path = project / "gpuctl.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def wait_until(check: Callable[[], bool], timeout: float, what: str, every: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def text_once_it_says(path: Path, needle: str, timeout: float = 30) -> str:
    """The file's text once it holds ``needle``: a process logs what it did after doing it, so a
    test that saw the deed may read the log before the line is there."""
    wait_until(lambda: path.exists() and needle in path.read_text(errors="replace"), timeout, f"{needle!r} in {path}")
    return path.read_text(errors="replace")


def assert_secret_absent(secret: str, *texts: str, dirs: tuple[Path, ...] = ()) -> None:
    """The secret is in none of the texts and in no file under dirs (bytes compared)."""
    for text in texts:
        assert secret not in text, "the API key leaked into command output"
    needle = secret.encode()
    for folder in dirs:
        for path in Path(folder).rglob("*"):
            if path.is_file() and not path.is_symlink():
                assert needle not in path.read_bytes(), f"the API key leaked into {path}"


class Killer:
    """Sends one signal to the gpuctl under test when a hook calls fire(), then holds that hook
    (the vendor's answer, the next request, the SSH step) until the test has seen gpuctl exit."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.proc: subprocess.Popen | None = None
        self.fired = False
        self.release = threading.Event()

    def fire(self) -> None:
        if self.fired or self.proc is None:
            return
        self.fired = True
        self.proc.send_signal(self.signum)
        self.release.wait(60)

    def run(self, project, *args: str) -> tuple[int, str]:
        self.proc = subprocess.Popen(
            [*GPUCTL, *args], cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            _out, err = self.proc.communicate(timeout=120)
        finally:
            self.release.set()
            if self.proc.poll() is None:
                self.proc.kill()
        assert self.fired, f"the step was never reached: {err[-3000:]}"
        return self.proc.returncode, err

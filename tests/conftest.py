"""Shared fixtures. Every test gets its own gpuctl state dir.

The fixture modules are registered here once: a test asks for ``sshd``, ``fresh_sshd``,
``s3_env``, ``s3_server``, ``fresh_bucket``, ``laptop_docker``, ``node_docker``,
``trainer_image`` ... by argument name and never imports a fixture. Plain helpers come from
``tests.helpers`` and the modules below.
"""

from __future__ import annotations

import os
import re
import signal
import warnings
from collections import defaultdict
from pathlib import Path

import pytest

from tests.helpers import Gpuctl, parent_of
from trainer.hostenv import ops_cache_default

pytest_plugins = [
    "tests.sshd",
    "tests.bastion",
    "tests.s3server",
    "tests.dockerd",
    "tests.trainer_image",
    "tests.stock_image",
    "tests.slurm",
]

# DeepSpeed JIT-compiles its CPU ops once; share the cache across tests and runs, in the folder
# a run of this Python environment uses (templates/launch.sh.j2), as tests/run.sh sets it.
ops_cache_default()


@pytest.fixture(autouse=True)
def state_dir(tmp_path_factory, monkeypatch) -> Path:
    path = tmp_path_factory.mktemp("state")
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(path))
    return path


@pytest.fixture
def project(tmp_path, monkeypatch):
    """An empty project folder as the cwd. What a test leaves running in it (a node's budget guard
    on a fake instance the vendor "terminated", a rank) is killed at the end, and named in a warning."""
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    if left := kill_left_running(tmp_path):
        warnings.warn(f"left running by the test, killed: {'; '.join(left)}", stacklevel=1)


def kill_left_running(folder: Path) -> list[str]:
    """SIGKILL every process whose working dir is inside `folder` or whose command line names it, but
    this one and what descends from it: a shared server that a fixture started while the cwd was
    `folder` (moto, sshd, dockerd and its containerd) is the fixture's to stop. Names what it killed."""
    inside, seen = str(folder), {}
    named = re.compile(re.escape(inside) + r"(/|\s|$)")  # test_x1 is not test_x10
    for entry in Path("/proc").iterdir():
        try:
            parent = parent_of(entry.name) if entry.name.isdigit() else 0
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            seen[int(entry.name)] = (parent, os.readlink(entry / "cwd"), cmdline)
        except (OSError, ValueError, IndexError):  # gone, a zombie, not ours to read, not a process
            continue
    killed = []
    for pid, (_parent, cwd, cmdline) in seen.items():
        ancestor = pid
        while ancestor in seen and ancestor != os.getpid():
            ancestor = seen[ancestor][0]
        if ancestor == os.getpid():
            continue
        if named.search(cmdline) or cwd == inside or cwd.startswith(inside + "/"):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(f"{pid} {cmdline[:80]}")
            except ProcessLookupError:
                pass
    return killed


@pytest.fixture
def gpuctl(project) -> Gpuctl:
    """gpuctl as a subprocess in the test's project folder, with this process's environment at
    each call: ``gpuctl("up", "--yes", env={"KEY": "v"}, timeout=60, check=True, input="n\\n")``
    (``env`` is laid over os.environ; ``cwd=`` picks another folder)."""
    return Gpuctl(project)


# Under pytest-xdist (tests/run.sh runs `-n N --dist loadgroup`), tests that share one engine that
# a session may hold only once go to one worker, in one group each: the image engine (a file lock
# on its persistent data root: a second worker would wait for the first's whole session) and the
# Slurm cluster (one slurmctld per session), which joins the first of the two lines of tests that start
# real ranks on this host (`slow`, RANKS_B below). Everything else spreads over the workers.
ONE_WORKER_FIXTURES = {
    "image_engine": "image-engine",
    "trainer_image": "image-engine",
    "stock_image": "image-engine",
    "slurm_cluster": "ranks",
}


# The modules whose slow tests form the second line of real-rank runs: about half the group's time
# (serial seconds in one full run: fsdp_e2e 267, trainer_end_of_run 215, storage_e2e 133, hardening_ckpt_load
# 117, first_cloud_run 110, ... of ~2,700). A module stays whole: its module-scoped runs and servers are shared.
RANKS_B = {
    "test_doctor_internode",
    "test_fsdp_e2e",
    "test_trainer_end_of_run",
    "test_cloud_runpod",
    "test_recovery_multinode",
    "test_cloud_aws",
    "test_trainer_parity",
    "test_hardening_ckpt_load",
    "test_first_cloud_run",
    "test_storage_e2e",
}


# tryfirst: xdist reads the groups in its own collection_modifyitems on the worker, so they must be on by then.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        for fixture, group in ONE_WORKER_FIXTURES.items():
            if fixture in item.fixturenames:
                item.add_marker(pytest.mark.xdist_group(group))
                break
        else:  # real ranks on this host: two serial lines (Slurm's with the first), each run alone uses ~1.2-1.5 cores
            if item.get_closest_marker("slow") and not item.get_closest_marker("xdist_group"):
                second = item.module.__name__.rsplit(".", 1)[-1] in RANKS_B
                item.add_marker(pytest.mark.xdist_group("ranks-b" if second else "ranks"))
    # The long ones first (the engines' groups, then the runs with real ranks): a worker that draws
    # one at the end is the tail of the whole run. Stable: a file's tests keep their order.
    items.sort(key=_start_order)


def pytest_collection_finish(session):
    """On an xdist worker under --dist loadgroup, every grouped test must carry its group in its node id:
    that suffix is all the scheduler reads. Without it the engines' tests spread over the workers and
    fight over one engine (pytest 9.2 + xdist 3.8 did that silently; pyproject pins pytest below it)."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    lost = [i.nodeid for i in session.items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
    if lost:
        raise pytest.UsageError(
            f"--dist loadgroup: {len(lost)} grouped tests have no group in their id ({lost[0]}); pytest-xdist does not support this pytest: pin pytest as pyproject.toml says"
        )


# Wall seconds of every test (setup, call, teardown) per xdist worker and per group, as the controller
# receives the reports: the serial lines and the busiest worker are the run's floor (tests/README.md).
_BUSY: defaultdict[str, float] = defaultdict(float)
_LINES: defaultdict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    worker = getattr(getattr(report, "node", None), "gateway", None)
    _BUSY[worker.id if worker else "main"] += report.duration
    _LINES[report.nodeid.rpartition("@")[2] if "@" in report.nodeid else "(no group)"] += report.duration


def pytest_terminal_summary(terminalreporter):
    if _BUSY:
        busy = ", ".join(f"{w} {s:.0f}s" for w, s in sorted(_BUSY.items()))
        lines = ", ".join(f"{g} {s:.0f}s" for g, s in sorted(_LINES.items(), key=lambda x: -x[1]))
        terminalreporter.write_line(f"busy per worker: {busy}; per group: {lines}")


def _start_order(item) -> int:
    if item.get_closest_marker("xdist_group"):
        return 0
    return 1 if item.get_closest_marker("slow") else 2

"""The budget guards a test starts on the stand-in node (this machine): end them, restart them as a
vendor's start-up would, read the deadline each start logged, and the cap a recovered run's new
node gets."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from tests.fakes.harness import wait_until


def kill_guards(root: Path) -> None:
    """A guard of a "deleted" node is still this machine's process: the test's to end."""
    killed = []
    for pid_file in root.glob("**/guard/*.pid"):
        try:
            pid = int(pid_file.read_text().strip())
            os.killpg(pid, signal.SIGKILL)
            killed.append(pid)
        except (ValueError, ProcessLookupError, PermissionError):
            pass
    wait_until(lambda: not any(running(pid) for pid in killed), 10, "the guards to end", every=0.05)


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's parent may be slow to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def guard_lines(log: Path) -> list[int]:
    """The deadline each start of the guard logged."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return [int(m) for m in re.findall(r"budget guard up: cap [^;]*; deadline (\d+)", text)]


def restart_and_check(folder: Path, boot: list[str], env: dict[str, str]) -> None:
    """Kill the guard as a container restart does, run the vendor's start-up, and check the guard
    runs again with the deadline it had."""
    old = int((folder / "guard.pid").read_text())
    (first,) = guard_lines(folder / "guard.log")
    os.killpg(old, signal.SIGKILL)
    wait_until(lambda: not running(old), 30, "the guard to die")
    done = subprocess.run(boot, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    wait_until(lambda: len(guard_lines(folder / "guard.log")) == 2, 30, "the guard to start again")
    new = int((folder / "guard.pid").read_text())
    assert new != old and b"guard.sh" in Path(f"/proc/{new}/cmdline").read_bytes()
    assert guard_lines(folder / "guard.log") == [first, first]  # the same deadline: the cap is not reset
    again = subprocess.run(boot, env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and int((folder / "guard.pid").read_text()) == new  # a running guard stays alone


def deadline_of(script: Path) -> int:
    """The instant a guard script tears its node down (baked in at `up`)."""
    found = re.search(r"^DEADLINE=(\d+)$", script.read_text(), re.M)
    assert found, f"no DEADLINE in {script}"
    return int(found[1])


def recovered_cap(project: Path, record, lose: Callable[[], None], monkeypatch, *, spent_cost: float):
    """Record `spent_cost` as what the run's earlier clusters cost, `lose()` the node, recover the
    run (training itself stubbed out): (the new cluster, the seconds of cap it got, the script of
    its node's guard)."""
    from provision.core import state
    from provision.core.config import load_config
    from provision.flows import cluster, job, recover
    from tests.fakes.harness import saved_run

    cfg = load_config(project / "gpuctl.yaml")
    try:
        state.save_cluster(record.model_copy(update={"spent_cost": spent_cost, "spent_hours": 1.0}))
        run = saved_run(record.name, "20261203-000000-cap1")
        lose()
        monkeypatch.setattr(job, "start_run", lambda *_a, **_k: state.load_run(run.run_id))
        recover.recover(cfg, run, "preempted", lambda _: None)
        new = state.load_cluster(record.name)
        cluster.down(new.name, lambda _: None)
    finally:
        kill_guards(project)
    assert spent_cost <= new.spent_cost < spent_cost + 0.05  # and what the lost cluster cost
    cap_s = (new.created_at + (new.budget_hours or 0) * 3600) - time.time()
    return new, cap_s, Path(new.nodes[0].workdir) / "guard" / "guard.sh"

"""`gpuctl up && gpuctl train` over SSH, for real: DeepSpeed CPU ranks behind a loopback sshd.

The two "nodes" are 127.0.0.1 and 127.0.0.2 (one sshd listening on both); the multi-node
run goes through DeepSpeed's pdsh launcher from the first node exactly as on two machines.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.fakes.harness import wait_until
from tests.helpers import GPUCTL, Gpuctl
from tests.sshd import SSHD

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
EXTENSIONS = os.environ.get(
    "TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions")
)


def write_config(project: Path, server: SSHD, hosts: list[str], *, name: str, cpu_ranks: int, **train) -> None:
    cfg = {
        "name": name,
        "provider": {
            "kind": "ssh",
            "hosts": hosts,
            "identity_file": str(server.client_key),
            "python": sys.executable,
            "cpu_ranks": cpu_ranks,
            "workdir": str(project / "node"),
            "authorized_keys": str(server.authorized_keys),
            "ready_timeout": 30,
        },
        "train": {"max_steps": 6, "checkpoint_every": 0, "seed": 1234, **train},
        "storage": {"url": str(project / "store")},
        # the ranks' shells start from sshd, not from this environment
        "env": {"TORCH_EXTENSIONS_DIR": EXTENSIONS},
    }
    project.mkdir(parents=True, exist_ok=True)
    (project / "gpuctl.yaml").write_text(yaml.safe_dump(cfg))


def run_record(state_dir: Path, run_id: str | None = None) -> dict:
    runs = sorted(state_dir.glob("runs/*.json"), key=lambda p: p.stat().st_mtime)
    path = state_dir / "runs" / f"{run_id}.json" if run_id else runs[-1]
    return json.loads(path.read_text())


def metrics(run_dir: str) -> list[dict]:
    path = Path(run_dir, "metrics.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def processes_in(folder: str) -> list[int]:
    """pids whose cwd is in folder (how gpuctl finds a run's processes, never by name)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cwd = os.readlink(proc / "cwd")
        except OSError:
            continue
        if cwd == folder or cwd.startswith(folder + "/"):
            found.append(int(proc.name))
    return found


class Follower:
    """A gpuctl command in the background whose output lines we can wait on."""

    def __init__(self, args: list[str], cwd: Path):
        self.proc = subprocess.Popen(
            [*GPUCTL, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._threads = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    @staticmethod
    def _pump(pipe, into: list[str]) -> None:
        for line in pipe:
            into.append(line.rstrip("\n"))

    def wait_line(self, needle: str, timeout: float) -> None:
        wait_until(lambda: any(needle in line for line in self.out), timeout, f"{needle!r} in the output")

    def finish(self, timeout: float) -> int:
        rc = self.proc.wait(timeout=timeout)
        for thread in self._threads:
            thread.join(timeout=10)
        return rc


@pytest.fixture(scope="module")
def single_node_run(sshd, tmp_path_factory):
    """One `gpuctl up && gpuctl train` on one SSH node with 2 CPU ranks (the parity baseline)."""
    project = tmp_path_factory.mktemp("single")
    state_dir = tmp_path_factory.mktemp("single-state")
    env = {"GPUCTL_STATE_DIR": str(state_dir)}
    write_config(project, sshd, [sshd.host()], name="single", cpu_ranks=2)
    gpuctl = Gpuctl(project)
    started = time.monotonic()
    up = gpuctl("up", env=env)
    assert up.returncode == 0, up.stderr
    train = gpuctl("train", env=env)
    took = time.monotonic() - started
    yield {
        "project": project,
        "state_dir": state_dir,
        "env": env,
        "gpuctl": gpuctl,
        "up": up,
        "train": train,
        "seconds": took,
    }
    gpuctl("down", env=env)


def test_single_node_up_train_status_down(single_node_run):
    run = single_node_run
    train, env, project, gpuctl = run["train"], run["env"], run["project"], run["gpuctl"]
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    assert "step 6/6" in train.stdout and "succeeded" in train.stdout
    assert "Include " in run["up"].stderr and "gpuctl-single" in run["up"].stderr
    status = json.loads(gpuctl("status", "--json", env=env).stdout)
    assert status["cluster"]["provider"] == "ssh"
    result = status["run"]
    assert result["state"] == "succeeded" and result["exit_code"] == 0
    assert result["steps"] == 6 and result["world_size"] == 2 and result["train_batch_size"] == 8
    assert result["run_dir"].startswith(str(project / "node" / "runs"))
    assert len(metrics(result["run_dir"])) == 6
    # the node really ran it: the run's files are there, read back through `gpuctl ssh`
    cat = gpuctl("ssh", "cat", f"{result['run_dir']}/summary.json", env=env)
    assert json.loads(cat.stdout)["state"] == "succeeded"
    down = gpuctl("down", env=env)
    assert down.returncode == 0, down.stderr
    assert processes_in(result["run_dir"]) == []
    assert json.loads(gpuctl("status", "--json", env=env).stdout)["cluster"] is None


def test_two_nodes_match_single_node(sshd, single_node_run, tmp_path, state_dir):
    baseline = metrics(run_record(single_node_run["state_dir"])["run_dir"])
    assert len(baseline) == 6
    project = tmp_path / "two"
    keys_before = sshd.authorized_keys.read_text()
    write_config(project, sshd, [sshd.host("127.0.0.1"), sshd.host("127.0.0.2")], name="two", cpu_ranks=1)
    gpuctl = Gpuctl(project)
    up = gpuctl("up")
    assert up.returncode == 0, up.stderr
    assert "node-to-node SSH ready" in up.stderr
    train = gpuctl("train")
    assert train.returncode == 0, train.stdout[-4000:] + train.stderr[-3000:]
    record = run_record(state_dir)
    log = Path(record["run_dir"], "job.log").read_text()
    # DeepSpeed's pdsh launcher started one rank on each node (pdsh prefixes lines with the host)
    assert "--launcher pdsh" in Path(record["run_dir"], "launch.sh").read_text()
    assert "127.0.0.2: " in log and "node_rank=1" in log and "dist_world_size=2" in log
    assert Path(record["run_dir"], "hostfile").read_text() == "127.0.0.1 slots=1\n127.0.0.2 slots=1\n"
    steps = metrics(record["run_dir"])
    assert [m["step"] for m in steps] == [m["step"] for m in baseline]
    for two, one in zip(steps, baseline, strict=True):
        assert abs(two["loss"] - one["loss"]) <= 1e-5 * max(1.0, abs(one["loss"])), (two, one)
    down = gpuctl("down")
    assert down.returncode == 0, down.stderr
    assert sshd.authorized_keys.read_text() == keys_before


def test_sshd_restart_mid_run_ctrl_c_detach_and_reattach(fresh_sshd, tmp_path, state_dir):
    server = fresh_sshd
    project = tmp_path / "restart"
    write_config(project, server, [server.host()], name="restart", cpu_ranks=1, max_steps=60)
    gpuctl = Gpuctl(project)
    assert gpuctl("up").returncode == 0
    train = Follower(["train"], project)
    wait_until(lambda: list(state_dir.glob("runs/*.json")), 400, "the run to start", every=0.05)
    record = run_record(state_dir)
    wait_until(lambda: metrics(record["run_dir"]), 400, "the first step", every=0.05)
    # A step takes a fraction of a second: freeze the run (SIGSTOP its process group) so that it is
    # provably still going while we detach and restart sshd, instead of racing it.
    os.killpg(record["pgid"], signal.SIGSTOP)
    try:
        assert len(metrics(record["run_dir"])) < 60
        train.wait_line("step 1/60", timeout=120)
        train.proc.send_signal(signal.SIGINT)  # Ctrl-C: detach, the run goes on
        assert train.finish(timeout=60) == 130
        assert any("detached" in line and "gpuctl logs -f" in line for line in train.err)
        status_file = Path(record["run_dir"], "status.json")
        assert json.loads(status_file.read_text())["state"] == "running"

        logs = Follower(["logs", "-f"], project)
        logs.wait_line("step ", timeout=120)
        done_before = len(metrics(record["run_dir"]))
        server.stop()  # every connection drops, the listener is gone
        time.sleep(6)  # the frozen run cannot end: `logs -f` has nothing to exit for but a bug
        assert json.loads(status_file.read_text())["state"] == "running"
        assert logs.proc.poll() is None  # still trying to reconnect
    finally:
        os.killpg(record["pgid"], signal.SIGCONT)
    server.start()
    assert logs.finish(timeout=400) == 0, "\n".join(logs.out[-20:] + logs.err[-20:])
    assert len(metrics(record["run_dir"])) == 60 > done_before
    assert any("step 60/60" in line for line in logs.out)
    assert any("succeeded" in line for line in logs.out + logs.err)
    for k in range(1, 61):  # resumed at its offset: every step line exactly once
        assert sum(line.endswith(f"step {k}/60") or f"step {k}/60 " in line for line in logs.out) == 1, k
    status = json.loads(gpuctl("status", "--json").stdout)["run"]
    assert status["state"] == "succeeded"
    assert gpuctl("down").returncode == 0


def test_cancel_stops_the_process_group_and_train_returns_the_exit_code(sshd, tmp_path, state_dir):
    project = tmp_path / "cancel"
    write_config(project, sshd, [sshd.host()], name="cancel", cpu_ranks=1, max_steps=500)
    gpuctl = Gpuctl(project)
    assert gpuctl("up").returncode == 0
    started = gpuctl("train", "--detach")
    assert started.returncode == 0, started.stderr
    record = run_record(state_dir, started.stdout.strip())
    wait_until(lambda: metrics(record["run_dir"]), 400, "the first step")
    assert processes_in(record["run_dir"])
    cancel = gpuctl("cancel")
    assert cancel.returncode == 0, cancel.stderr
    assert processes_in(record["run_dir"]) == []
    assert json.loads(Path(record["run_dir"], "status.json").read_text())["state"] == "cancelled"

    (project / "empty.txt").write_text("")  # no tokens: the trainer fails with its own exit code
    cfg = yaml.safe_load((project / "gpuctl.yaml").read_text())
    cfg["train"].update(data="empty.txt", max_steps=2)
    (project / "gpuctl.yaml").write_text(yaml.safe_dump(cfg))
    failed = gpuctl("train")
    status = json.loads(Path(run_record(state_dir)["run_dir"], "status.json").read_text())
    assert status["state"] == "failed" and status["exit_code"] not in (0, None)
    assert failed.returncode == status["exit_code"], failed.stderr[-2000:]
    assert gpuctl("down").returncode == 0


def test_down_stops_ranks_on_every_node(sshd, tmp_path, state_dir):
    project = tmp_path / "down2"
    write_config(
        project, sshd, [sshd.host("127.0.0.1"), sshd.host("127.0.0.2")], name="down2", cpu_ranks=1, max_steps=500
    )
    gpuctl = Gpuctl(project)
    assert gpuctl("up").returncode == 0
    started = gpuctl("train", "--detach")
    assert started.returncode == 0, started.stderr
    record = run_record(state_dir, started.stdout.strip())
    wait_until(lambda: metrics(record["run_dir"]), 400, "the first step")
    assert len(processes_in(record["run_dir"])) >= 5  # launch.sh, runner, pdsh, 2 x (launch + rank)
    down = gpuctl("down")
    assert down.returncode == 0, down.stderr
    wait_until(lambda: processes_in(record["run_dir"]) == [], 30, "every run process to end")
    assert json.loads(Path(record["run_dir"], "status.json").read_text())["state"] == "cancelled"

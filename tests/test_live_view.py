"""Watching a run for real: `gpuctl train` on the local provider (3 CPU ranks, the tiny model) in a
real terminal (tmux) and on a pipe: the live view, Ctrl-C detach and `logs -f` reattach, plain
lines, JSON lines, the summary."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from tests.fakes.harness import wait_until
from tests.helpers import Gpuctl

pytestmark = pytest.mark.slow
ESC = "\x1b"


def write_config(project: Path, gpuctl: Gpuctl, **train) -> None:
    assert gpuctl("init").returncode == 0
    cfg = yaml.safe_load((project / "gpuctl.yaml").read_text())
    cfg["train"].update(train)
    (project / "gpuctl.yaml").write_text(yaml.safe_dump(cfg))


class Terminal:
    """A 160x40 tmux pane running bash, on a tmux server of its own (private socket)."""

    def __init__(self, cwd: Path):
        self.socket, self.name = f"gpuctl-test-{uuid.uuid4().hex[:8]}", "view"
        self.tmux(
            "new-session", "-d", "-x", "160", "-y", "40", "-s", self.name, "-c", str(cwd), "bash --norc --noprofile"
        )

    def tmux(self, *args: str) -> str:
        out = subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        return out.stdout

    def type(self, line: str) -> None:
        self.tmux("send-keys", "-t", self.name, line, "Enter")

    def screen(self) -> str:
        """What the pane shows now, with its scrollback."""
        return self.tmux("capture-pane", "-p", "-t", self.name, "-S", "-2000")

    def wait_for(self, what: str, check, timeout: float) -> str:
        found: list[str] = []

        def ok() -> bool:
            found[:] = [self.screen()]
            return bool(check(found[0]))

        try:
            wait_until(ok, timeout, what, every=0.2)
        except AssertionError:
            raise AssertionError(f"{what}; the screen:\n{found[0] if found else ''}") from None
        return found[0]

    def clear(self, gone: str) -> None:
        """An empty screen and scrollback (checked: `gone` is no longer in them)."""
        self.type("clear")

        def cleared(screen: str) -> bool:
            self.tmux("clear-history", "-t", self.name)
            return gone not in screen

        self.wait_for("a clear screen", cleared, 30)

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=30)
        Path(f"/tmp/tmux-{os.getuid()}", self.socket).unlink(missing_ok=True)  # the server leaves its socket file


@pytest.fixture
def terminal(project):
    term = Terminal(project)
    yield term
    term.close()


def test_live_view_in_a_terminal_detaches_and_reattaches(project, gpuctl, state_dir, terminal):
    write_config(project, gpuctl, max_steps=30, checkpoint_every=0)
    with_steps = re.compile(r"\b[1-9]\d*/30 steps")
    assert gpuctl("up").returncode == 0
    try:
        gpuctl_cmd = f"{sys.executable} -m provision.cli"
        terminal.type(f"{gpuctl_cmd} train; echo TRAIN-EXIT=$?")
        terminal.wait_for("the progress bar past step 0", lambda s: with_steps.search(s) and "━" in s, 600)
        watch_detach_reattach(terminal, gpuctl_cmd, state_dir, with_steps)
    finally:
        assert gpuctl("down").returncode == 0  # also stops a run a failure left going


def watch_detach_reattach(terminal: Terminal, gpuctl_cmd: str, state_dir: Path, with_steps: re.Pattern) -> None:
    logs_exit = re.compile(r"LOGS-EXIT=\d")  # the command line typed shows LOGS-EXIT=$?
    # Freeze the run (its process group) so it provably goes on while we detach and reattach.
    record = json.loads(next(state_dir.glob("runs/*.json")).read_text())
    os.killpg(record["pgid"], signal.SIGSTOP)
    try:
        live = terminal.screen()
        assert "loss" in live and "tokens/s" in live and "ETA" in live and f"run {record['run_id']}" in live
        assert "✓ tokenizing data" in live and "✓ loading model" in live  # the phases before the first step
        assert "[INFO]" not in live and "launch.py" not in live  # DeepSpeed's launcher lines stay in job.log
        assert live.count(f"run {record['run_id']} started") == 1
        assert planned_text(state_dir, record["run_id"]) in live  # the mean step beside what `train` predicted
        terminal.tmux("send-keys", "-t", terminal.name, "C-c")
        terminal.wait_for("the detach", lambda s: "TRAIN-EXIT=130" in s, 60)
        assert json.loads(Path(record["run_dir"], "status.json").read_text())["state"] == "running"
        terminal.clear(gone="TRAIN-EXIT")
        terminal.type(f"{gpuctl_cmd} logs -f; echo LOGS-EXIT=$?")
        again = terminal.wait_for(
            "the same view again", lambda s: with_steps.search(s) and not logs_exit.search(s), 120
        )
        assert "loss" in again and "tokens/s" in again and "[INFO]" not in again
        assert planned_text(state_dir, record["run_id"]) in again
    finally:
        os.killpg(record["pgid"], signal.SIGCONT)
    end = terminal.wait_for("the end of the run", logs_exit.search, 600)
    assert "LOGS-EXIT=0" in end and "30/30 steps" in end
    assert f"run {record['run_id']} succeeded" in end and "steps 30/30" in end
    assert "gpuctl ckpt pull step30 --hf ./step30-hf" in end and "wall time" in end
    assert "[INFO]" not in end


def planned_text(state_dir: Path, run_id: str) -> str:
    """The live view's "vs plan" figures: the step `train` predicted and kept for this run, saves apart."""
    from provision.estimate.forecast import step_apart

    planned = step_apart(json.loads((state_dir / "results" / run_id / "prediction.json").read_text()))
    assert planned is not None
    mid, low, high = planned
    return f" s mean (plan {mid:.3g} s, {low:.3g}-{high:.3g}), measured/plan "


def test_on_a_pipe_plain_lines_and_json_lines(project, gpuctl, state_dir):
    write_config(project, gpuctl, max_steps=6, log_every=2, checkpoint_every=0)
    assert gpuctl("up").returncode == 0
    try:
        on_a_pipe(gpuctl)
    finally:
        assert gpuctl("down").returncode == 0


def on_a_pipe(gpuctl: Gpuctl) -> None:
    train = gpuctl("train", "--json")
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    assert ESC not in train.stdout + train.stderr
    rows = [json.loads(line) for line in train.stdout.splitlines()]  # every line is one JSON object
    assert [r["step"] for r in rows if r["type"] == "step"] == [1, 2, 4, 6]  # log_every 2, first and last
    phases = [r["name"] for r in rows if r["type"] == "phase"]
    assert phases[-4:] == ["tokenizing data", "loading model", "initializing DeepSpeed", "first step"]
    published = [r["tag"] for r in rows if r["type"] == "checkpoint" and r["state"] == "published"]
    assert published == ["step6"]
    summary = rows[-1]
    assert summary["type"] == "summary" and summary["state"] == "succeeded" and summary["steps"] == 6
    assert summary["final_loss"] < summary["first_loss"] and summary["tokens_per_s"] > 0
    # each phase before the first step timed (flows/startup_phases.py), as the view showed them
    assert set(phases[-4:]) <= set(summary["phases"]) and all(v >= 0 for v in summary["phases"].values())
    assert train.stderr.count("started") == 1

    plain = gpuctl("logs", "-f")  # stdout is a pipe here too: plain lines
    assert plain.returncode == 0, plain.stderr
    assert ESC not in plain.stdout + plain.stderr and "[INFO]" not in plain.stdout
    lines = plain.stdout.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["1/6", "2/6", "4/6", "6/6"]
    assert "phase: tokenizing data: sample" in lines and "checkpoint step6 published" in lines
    assert f"run {summary['run_id']} succeeded" in lines
    assert any(line.startswith("  before the first step: ") and line.endswith(" s measured") for line in lines)
    assert "  get it as a Hugging Face model: gpuctl ckpt pull step6 --hf ./step6-hf" in lines

    verbatim = gpuctl("logs", "-f", "-v")  # everything, as job.log has it
    assert "[INFO]" in verbatim.stdout and "trainer: model tiny" in verbatim.stdout
    status = gpuctl("status")
    assert socket.gethostname() in status.stdout and "localhost:22" not in status.stdout
    assert "before the first step: " in status.stdout  # summary.json's phases, measured on the node

"""A node's bytes never drive the user's terminal (issue 34, item 8): the live view, plain lines,
`gpuctl logs` and `train -v` strip OSC and CSI sequences (screen clear, window title, OSC 52
clipboard writes), C1 controls and BEL, and keep the text around them; `gpuctl logs --raw` is the
one way to get the bytes as they are. The summary's `ckpt pull TAG` line quotes the node's tag.
"""

from __future__ import annotations

import json
import shlex
from io import StringIO
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console
from typer.testing import CliRunner

from provision.cli import live
from provision.cli.app import app
from provision.cli.run_text import summary_lines, summary_of
from provision.cli.runview import PlainSink
from provision.core import state
from provision.core.terminal import scrub
from provision.flows.job import RunStatus
from provision.flows.watch import Feed, RunInfo, WatchState
from provision.transport.remote import LocalNode
from tests.fakes.harness import saved_run

RUNNER = CliRunner()
OSC52 = "\x1b]52;c;cm0gLXJmIH4K\x07"  # write "rm -rf ~" to the clipboard
TITLE = "\x1b]0;you have been pwned\x1b\\"
CLEAR = "\x1b[2J\x1b[H"
C1_CSI = "\x9b31m"
HOSTILE = [OSC52, TITLE, CLEAR, C1_CSI, "\x07", "\x1bc", "\x9d8;;http://x\x9c", "\x1bP1$qm\x1b\\", "\r", "\x08"]


def clean(text: str) -> bool:
    """No ESC, no BEL, no other C0 control but tab and newline, no DEL, no C1 control."""
    return not any(ord(c) < 32 and c not in "\t\n" or 0x7F <= ord(c) <= 0x9F for c in text)


# --- the sanitizer ------------------------------------------------------------------------------------

SAFE = st.text(
    st.characters(blacklist_categories=("Cc", "Cs", "Cf")).filter(lambda c: c not in "[]PX^_\\"), max_size=20
)
PARAMS = st.text(st.sampled_from("0123456789;:<=>?"), max_size=8)
SEQUENCES = st.one_of(
    st.builds(lambda p, f: f"\x1b[{p}{f}", PARAMS, st.sampled_from("mHJKABCDhlsu")),  # CSI
    st.builds(lambda p, f: f"\x9b{p}{f}", PARAMS, st.sampled_from("mHJK")),  # 8-bit CSI
    st.builds(
        lambda intro, body, end: f"{intro}{body}{end}",
        st.sampled_from(["\x1b]", "\x9d", "\x1bP", "\x90", "\x1b_", "\x9f", "\x1b^", "\x1bX"]),
        st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30),
        st.sampled_from(["\x07", "\x1b\\", "\x9c"]),
    ),  # OSC, DCS, APC, PM, SOS strings up to ST or BEL
    st.sampled_from(["\x1bc", "\x1b7", "\x1b8", "\x1b(B", "\x07", "\x9c", "\x85", "\x00", "\x7f", "\r"]),
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(parts=st.lists(st.tuples(SAFE, SEQUENCES), max_size=6), tail=SAFE)
def test_sequences_go_and_the_text_around_stays(parts, tail):
    text = "".join(safe + seq for safe, seq in parts) + tail
    out = scrub(text, newlines=True)
    assert clean(out), repr(out)
    assert out == "".join(safe for safe, _ in parts) + tail


@settings(max_examples=300, deadline=None, derandomize=True)
@given(text=st.text())
def test_any_text_comes_out_clean(text):
    out = scrub(text)
    assert clean(out) and "\n" not in out
    assert scrub(out) == out


# --- where a node's bytes are shown --------------------------------------------------------------------


def hostile_run(folder: Path) -> tuple:
    """A run whose files carry escapes in every string a view shows."""
    folder.mkdir(parents=True, exist_ok=True)
    tag = f"step4{OSC52}"
    events = [
        {"time": 10.0, "kind": "phase", "name": f"tokenizing{CLEAR} data", "detail": f"sample{TITLE}"},
        {"time": 11.0, "kind": "checkpoint", "tag": tag, "state": f"published{C1_CSI}", "bytes": 10},
    ]
    (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    metric = {"step": 4, "loss": 1.5, "tokens_per_s": 10.0, "step_time_s": 0.1, "time": 12.0}
    (folder / "metrics.jsonl").write_text(json.dumps(metric) + "\n")
    (folder / "job.log").write_text(f"trainer: warning: disk{OSC52} almost full{CLEAR}!\nfine\n")
    (folder / "status.json").write_text(json.dumps({"state": "failed", "exit_code": 1, "started_at": 1, "ended_at": 9}))
    summary = {"state": "failed", "last_checkpoint": tag, "error": f"RuntimeError: boom{TITLE}\nsecond line"}
    (folder / "summary.json").write_text(json.dumps(summary))
    run = saved_run("esc", "20260101-000000-escs", run_dir=str(folder))
    st_ = WatchState(RunInfo.of(run))
    update = Feed(run).poll(LocalNode())
    st_.apply(update)
    return run, st_, update


def test_plain_lines_carry_no_escape_and_keep_the_text(tmp_path, capsys):
    _run, st_, update = hostile_run(tmp_path / "run")
    PlainSink().update(st_, update)
    out = capsys.readouterr().out
    assert clean(out), repr(out)
    for text in ("trainer: warning: disk almost full!", "phase: tokenizing data: sample", "error: RuntimeError: boom"):
        assert text in out, out
    assert "checkpoint step4 published" in out


def test_the_live_view_carries_no_escape(tmp_path):
    _run, st_, _update = hostile_run(tmp_path / "run")
    console = Console(file=StringIO(), force_terminal=False, width=160)
    console.print(live.screen(st_, 0.0))
    console.print("\n".join(summary_lines(st_)))
    for line in st_.fresh_alerts:
        console.print(line)
    assert clean(console.file.getvalue()), repr(console.file.getvalue())


@settings(max_examples=200, deadline=None, derandomize=True)
@given(tag=st.text(min_size=1, max_size=40))
def test_the_pull_line_quotes_the_nodes_tag(tag):
    run = state.RunRecord(
        run_id="r1", cluster="c", run_dir="/x", bundle_dir="/nonexistent", world_size=1,
        train_batch_size=1, micro_batch=1, grad_accum=1, max_steps=1,
    )  # fmt: skip
    st_ = WatchState(RunInfo(run, None, {}, None))
    st_.status = RunStatus(run, "succeeded", 0, {}, {"last_checkpoint": tag}, {})
    pull = summary_of(st_)["pull"]  # pasted into a shell, it runs `ckpt pull` of that tag, nothing else
    assert shlex.split(pull) == ["gpuctl", "ckpt", "pull", tag, "--hf", f"./{tag}-hf"]


@pytest.fixture
def hostile_log(project, state_dir):
    (project / "gpuctl.yaml").write_text("name: esc\nstorage:\n  url: ./store\n")
    run_dir = project / "run"
    run_dir.mkdir()
    log = f"hello {OSC52}world{CLEAR}{TITLE}!\n\x9b2Jplain\n"
    (run_dir / "job.log").write_text(log)
    (run_dir / "status.json").write_text(json.dumps({"state": "succeeded", "exit_code": 0}))
    state.save_cluster(state.ClusterRecord(name="esc", provider="local", nodes=[state.NodeRecord(host="localhost")]))
    saved_run("esc", "20260101-000000-logs", run_dir=str(run_dir))
    return log


def test_logs_strips_escapes_and_raw_keeps_them(hostile_log):
    shown = RUNNER.invoke(app, ["logs"])
    assert shown.exit_code == 0, shown.output
    assert shown.stdout == "hello world!\nplain\n"
    raw = RUNNER.invoke(app, ["logs", "--raw"])
    assert raw.exit_code == 0 and raw.stdout == hostile_log

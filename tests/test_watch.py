"""The run watcher's parts without a run: which job.log lines reach the screen, incremental reads
of a growing file through the real local transport, phases folded from events, the views' text."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from provision.cli.live import sparkline
from provision.cli.run_text import step_line, summary_lines
from provision.cli.runview import PlainSink
from provision.core import state
from provision.flows.job import RunStatus
from provision.flows.watch import RunInfo, Tail, Update, WatchState, alert_line
from provision.transport.remote import LocalNode
from provision.transport.ssh.node import SSHNode

DS_INFO = "[2026-12-03 07:37:09,475] [INFO] [launch.py:170:main] dist_world_size=3"
DS_WARN = "[2026-12-03 07:37:09,475] [WARNING] [engine.py:1:x] something odd"


@pytest.mark.parametrize(
    ("line", "shown"),
    [
        (DS_INFO, False),
        ("[2026-12-03 07:37:42,573] [INFO] [launch.py:285:main] Process 6627 exits successfully.", False),
        ("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully", False),
        ("step 3/8 loss 4.9213 lr 1.0e-03 tok/s 3539 step_time 0.43s", False),
        ("trainer: model tiny: 0.86M params, fp32, vocab 259", False),
        (DS_WARN, True),
        ("[2026-12-03 07:37:09,475] [ERROR] [engine.py:1:x] broken", True),
        ("trainer: warning: the storage credentials are temporary", True),
        ("trainer: error: checkpoint step4 was saved by 3 ranks", True),
        ("Traceback (most recent call last):", True),
        ("RuntimeError: CUDA out of memory", True),
        ("checkpoint step4: attempt 1 failed: timeout; retrying in 1.0 s", True),
    ],
)
def test_only_warnings_and_errors_of_the_log_reach_the_screen(line, shown):
    assert alert_line(line) is shown


def test_a_tail_returns_whole_lines_once_each_as_the_file_grows(tmp_path):
    path = tmp_path / "metrics.jsonl"
    node, tail = LocalNode(), Tail(str(path))
    assert tail.read(node) == []  # not there yet
    path.write_text('{"step": 1}\n{"st')
    assert tail.read(node) == ['{"step": 1}']  # the half-written record waits
    with path.open("a") as handle:
        handle.write('ep": 2}\n')
    assert tail.read(node) == ['{"step": 2}']
    assert tail.read(node) == []


def _state(max_steps: int = 8) -> WatchState:
    run = state.RunRecord(
        run_id="r1", cluster="c", run_dir="/x", bundle_dir="/nonexistent", world_size=3,
        train_batch_size=12, micro_batch=1, grad_accum=4, max_steps=max_steps,
    )  # fmt: skip
    return WatchState(RunInfo(run, None, {"log_every": 1}, "file:///store"))


def _status(st: WatchState, run_state: str, summary: dict | None = None) -> RunStatus:
    times = {"started_at": 100, "ended_at": 160 if run_state != "running" else None}
    return RunStatus(st.info.run, run_state, 0 if run_state == "succeeded" else None, times, summary or {}, {})


def test_phases_end_when_the_next_begins_and_at_the_first_step():
    st = _state()
    events = [
        {"time": 10.0, "kind": "phase", "name": "tokenizing data", "detail": "sample"},
        {"time": 12.5, "kind": "phase", "name": "initializing DeepSpeed", "detail": "compiling", "expect_s": 110},
    ]
    st.apply(Update(_status(st, "running"), [DS_INFO, DS_WARN], [], events))
    assert [p.name for p in st.phases] == ["tokenizing data", "initializing DeepSpeed"]
    assert st.phases[0].ended == 12.5 and st.current_phase is st.phases[1] and st.current_phase.expect_s == 110
    assert st.fresh_alerts == [DS_WARN]
    st.apply(Update(_status(st, "running"), [], [{"step": 1, "loss": 5.0, "time": 20.0}], []))
    assert st.current_phase is None and st.phases[1].ended == 20.0 and st.fresh_alerts == []


def test_the_plain_view_prints_one_line_per_record_and_a_summary_without_escape_codes(capsys):
    st, sink = _state(max_steps=2), PlainSink()
    first = Update(_status(st, "running"), [DS_INFO], [{"step": 1, "loss": 5.25, "tokens_per_s": 3000.0}], [])
    st.apply(first)
    sink.update(st, first)
    summary = {"steps": 2, "first_loss": 5.25, "final_loss": 4.5, "tokens_per_s": 3100.0, "last_checkpoint": "step2"}
    end = Update(
        _status(st, "succeeded", summary),
        [],
        [{"step": 2, "loss": 4.5}],
        [{"kind": "checkpoint", "tag": "step2", "state": "published"}],
    )
    st.apply(end)
    sink.update(st, end)
    out = capsys.readouterr().out
    assert "\x1b" not in out and "[INFO]" not in out
    lines = out.splitlines()
    assert lines[0].startswith("step 1/2 loss 5.2500") and "checkpoint step2 published" in lines
    assert "step 2/2 loss 4.5000" in out and "run r1 succeeded" in out and "wall time 0:01:00" in out
    assert "gpuctl ckpt pull step2 --hf ./step2-hf" in out and "file:///store" in out


def test_a_failed_run_says_its_exit_code_and_error():
    st = _state()
    status = RunStatus(st.info.run, "failed", 2, {}, {"state": "failed", "error": "no tokens"}, {})
    st.apply(Update(status, [], [], []))
    text = "\n".join(summary_lines(st))
    assert "run r1 failed (exit 2)" in text and "error: no tokens" in text and "ckpt pull" not in text


def test_step_line_shows_mfu_and_memory_when_the_node_has_them():
    rec = {
        "step": 3,
        "loss": 1.0,
        "lr": 1e-3,
        "tokens_per_s": 10.0,
        "step_time_s": 0.5,
        "mfu": 0.3,
        "peak_mem_gb": [2, 3.5],
    }
    assert step_line(rec, 9).endswith("mfu 30.0% mem 3.5GB")


def test_sparkline_falls_with_the_loss():
    line = sparkline([5.0, 4.0, 3.0, 2.0])
    assert len(line) == 4 and line[0] == "█" and line[-1] == "▁"
    assert sparkline([1.0]) == ""


def test_a_superseded_upload_is_said_and_counted_while_the_newest_checkpoint_stays_shown(capsys):
    """Saves faster than uploads: the trainer skips a waiting upload (events.jsonl state "superseded")."""
    from rich.console import Console

    from provision.cli.live import figures

    st, sink = _state(max_steps=4), PlainSink()
    events = [
        {"kind": "checkpoint", "tag": "step1", "state": "uploading", "bytes": 13_700_000},
        {"kind": "checkpoint", "tag": "step2", "state": "uploading", "bytes": 13_700_000},
        {"kind": "checkpoint", "tag": "step3", "state": "saving"},
        {"kind": "checkpoint", "tag": "step2", "state": "superseded"},
    ]
    new = Update(_status(st, "running"), [], [{"step": 3, "loss": 5.0}], events)
    st.apply(new)
    sink.update(st, new)
    assert st.superseded == ["step2"] and st.checkpoint["tag"] == "step3"
    assert "checkpoint step2 superseded (upload skipped: a newer save replaces it" in capsys.readouterr().out
    console = Console(width=200, record=True)
    console.print(figures(st))
    assert "step3 saving; 1 superseded (upload skipped), last step2" in console.export_text()


METRICS = """\
{"step": 1, "loss": 5.61, "tokens_per_s": 900.0, "step_time_s": 2.4, "fwd_bwd_s": 2.0, "optimizer_s": 0.4, "time": 10.0}
{"step": 2, "loss": 5.43, "tokens_per_s": 5100.0, "step_time_s": 0.3, "fwd_bwd_s": 0.2, "optimizer_s": 0.1, "time": 10.3}
{"step": 3, "loss": 5.20, "tokens_per_s": 3100.0, "step_time_s": 0.5, "fwd_bwd_s": 0.4, "optimizer_s": 0.1, "time": 10.8}
"""


def test_the_live_view_shows_the_measured_mean_step_beside_what_train_predicted(state_dir):
    """The prediction is the one `train` saved with the run (here: calibrated by a recorded doctor JSON, so
    plan's tables would give other figures), its step without the amortised save, as step_time_s is."""
    import json
    from pathlib import Path

    from rich.console import Console

    from provision.cli.live import figures
    from provision.estimate.doctor_speed import raw_rates
    from provision.estimate.forecast import save_prediction
    from provision.estimate.plan import plan
    from provision.estimate.plan_input import PlanInput
    from provision.estimate.step_time import predict

    doctor = json.loads((Path(__file__).parent / "data" / "doctor_rates" / "cpu-3ranks-tiny-seq128.json").read_text())
    tiny = PlanInput(model="tiny", gpus_per_node=3, micro_batch=1, seq_len=128, grad_accum=4, precision="fp32",
                     gradient_checkpointing=False)  # fmt: skip
    model = predict(plan(tiny), accelerator="cpu", doctor={"n": raw_rates(doctor)}, checkpoint_every=1)
    save_prediction(state_dir / "results" / "r1", model)  # what `train` does once the run started
    run = _state().info.run
    st = WatchState(RunInfo.of(run))
    console = Console(width=200, record=True)
    console.print(figures(st))
    assert "vs plan" not in console.export_text()  # no step yet: nothing measured to set beside it
    st.apply(Update(_status(st, "running"), [], [json.loads(line) for line in METRICS.splitlines()], []))
    console.print(figures(st))
    saves_apart = [t for t in model.terms if t.name != "checkpoint"]
    mid, low, high = (sum(t.seconds for t in saves_apart), model.fast_s, model.slow_s)
    low -= next(t.fast_s for t in model.terms if t.name == "checkpoint")
    high -= next(t.slow_s for t in model.terms if t.name == "checkpoint")
    text = console.export_text()
    row = next(line for line in text.splitlines() if line.startswith("vs plan"))
    assert (
        row.split(None, 2)[2].rstrip()
        == f"step 0.4 s mean (plan {mid:.3g} s, {low:.3g}-{high:.3g}), measured/plan {0.4 / mid:.2f}"
    )
    tables = predict(plan(tiny), accelerator="cpu", checkpoint_every=1)
    assert f"plan {tables.step_s:.3g} s" not in text  # not recomputed from plan's tables

    run.run_id = "r2"  # a run `train` predicted nothing for (a model plan does not know): no row
    other = WatchState(RunInfo.of(run))
    other.apply(Update(_status(other, "running"), [], [json.loads(METRICS.splitlines()[1])], []))
    console.print(figures(other))
    assert other.info.prediction is None and console.export_text().count("vs plan") == 0


def _append_later(path: Path, text: str, after_s: float) -> threading.Timer:
    def append() -> None:
        with path.open("a") as fh:
            fh.write(text)

    timer = threading.Timer(after_s, append)
    timer.start()
    return timer


def _waited(node, read: dict[str, int], timeout: float) -> float:
    start = time.monotonic()
    node.wait_for_growth(read, timeout)
    return time.monotonic() - start


@pytest.mark.parametrize("kind", ["local", "ssh"])
def test_the_wait_between_polls_ends_when_the_node_writes_a_line(request, tmp_path, kind):
    """train's view reads the node again as soon as a file grew (a stat every 50 ms, over SFTP for
    an SSH node), not at the next fixed poll; with nothing new, or only the bytes of a character
    still being written, it waits its whole timeout."""
    if kind == "local":
        node = LocalNode()
    else:
        server = request.getfixturevalue("sshd")
        node = SSHNode("127.0.0.1", server.port, server.user, str(server.client_key), pin_new=True)
    log, metrics = tmp_path / "job.log", tmp_path / "metrics.jsonl"  # metrics: not written yet
    log.write_text("step 1/9\n")
    read = {str(log): log.stat().st_size, str(metrics): 0}
    assert _waited(node, read, 0.6) >= 0.6
    log.write_bytes(log.read_bytes() + "é".encode()[:1])  # half a character: read_new leaves it
    assert _waited(node, read, 0.6) >= 0.6
    timer = _append_later(metrics, '{"step": 2}\n', 0.3)
    waited = _waited(node, read, 60)
    timer.join(10)
    assert metrics.stat().st_size > 0 and 0.3 <= waited < 30  # woken by the write, long before the timeout
    node.close()

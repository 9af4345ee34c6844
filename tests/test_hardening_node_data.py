"""What a node sends back is checked before it is stored or shown (issue 34, item 6 and LOW), and a
damaged record concerns only its own cluster.

- status.json with `"exit_code": "pwn"`, 2**80, a state that is no state...: ignored with one
  warning; the run record stays loadable, `status` and `down` work, the exit code is a shell's;
- an event with `"time": "soon"`: skipped with a warning, no traceback;
- hypothesis: any JSON in status.json, summary.json, metrics.jsonl and events.jsonl;
- a 64 MiB status.json is not read (memory stays flat), over the local transport and SSH;
- job.log is read in bounded pieces, and fetch_results keeps only valid metrics, bounded;
- a damaged run record of another cluster does not block `down`; a damaged cluster record does
  not block `up` of another; `down` of a damaged rented cluster terminates what the vendor lists
  for it, and no fix tells the user to delete a record that owns an instance.
"""

from __future__ import annotations

import json
import tempfile
import tracemalloc
from io import StringIO
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console
from typer.testing import CliRunner

from provision.cli import live
from provision.cli.app import app
from provision.cli.run_text import summary_lines
from provision.cli.runview import PlainSink
from provision.core import state
from provision.core.config import load_config
from provision.flows import cluster, job, nodedata
from provision.flows.watch import Feed, RunInfo, WatchState
from provision.providers.base import UpOptions
from provision.transport.remote import LocalNode
from provision.transport.ssh.node import SSHNode
from tests.fakes.harness import node_fields, saved_run, serve_vast, write_config

pytestmark = pytest.mark.timeout(240)
RUNNER = CliRunner()
RUN_ID = "20260101-000000-node"


def local_cluster(project: Path, name: str = "nd") -> state.ClusterRecord:
    (project / "gpuctl.yaml").write_text(yaml.safe_dump({"name": name, "storage": {"url": "./store"}}))
    record = cluster.up(load_config(project / "gpuctl.yaml"), UpOptions(say=lambda _: None, doctor=False))
    assert record is not None
    return record


def run_with_files(folder: Path, files: dict[str, str | bytes], cluster_name: str = "nd") -> state.RunRecord:
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return saved_run(cluster_name, RUN_ID, run_dir=str(folder))


def one_error_line(result) -> str:
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    return errors[0]


# --- status.json --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "doc",
    [
        {"state": "failed", "exit_code": "pwn"},
        {"state": "failed", "exit_code": 2**80},
        {"state": "failed", "exit_code": -5},
        {"state": "pwn\x1b]52;c;cGF5bG9hZA==\x07", "exit_code": 1},
        {"state": "running", "started_at": "soon"},
        [1, 2],
    ],
)
def test_a_hostile_status_json_is_ignored_with_a_warning_and_status_and_down_still_work(project, doc):
    local_cluster(project)
    run = run_with_files(project / "node-run", {"status.json": json.dumps(doc)})
    result = RUNNER.invoke(app, ["status"])
    assert result.exit_code == 0, result.output
    assert "warning: status.json from the node is not what gpuctl writes" in result.stderr
    assert "\x1b" not in result.output
    recorded = state.load_run(run.run_id)  # still a record that loads
    assert recorded.exit_code is None or 0 <= recorded.exit_code <= 255
    assert 0 <= job.exit_code_of(job.read_status(recorded, LocalNode())) <= 255
    assert RUNNER.invoke(app, ["down", "--yes"]).exit_code == 0
    assert state.find_cluster("nd") is None


def test_an_event_at_time_soon_is_skipped_with_one_warning(tmp_path):
    events = [
        {"time": "soon", "kind": "phase", "name": "tokenizing data"},
        {"time": 12.0, "kind": "phase", "name": "initializing DeepSpeed"},
        {"time": 13.0, "kind": "checkpoint", "tag": "step1", "state": "saved", "bytes": "lots"},
    ]
    run = run_with_files(tmp_path / "run", {"events.jsonl": "".join(json.dumps(e) + "\n" for e in events)})
    feed, st = Feed(run), WatchState(RunInfo.of(run))
    update = feed.poll(LocalNode())
    st.apply(update)
    assert [p.name for p in st.phases] == ["initializing DeepSpeed"] and not st.checkpoint
    notes = [a for a in st.fresh_alerts if "events.jsonl" in a]
    assert len(notes) == 1 and "time" in notes[0]
    st.apply(feed.poll(LocalNode()))
    assert not [a for a in st.fresh_alerts if "events.jsonl" in a]  # said once


# --- hypothesis: any JSON from the node -------------------------------------------------------------

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**90), max_value=2**90)
    | st.floats()
    | st.text(max_size=30)
    | st.sampled_from(["soon", "running", "failed", "succeeded", "\x1b]52;c;eA==\x07", "\x9b2J", "phase"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=10,
)
KEYS = {
    "status": ["state", "exit_code", "started_at", "ended_at", "pid", "pgid"],
    "summary": ["state", "steps", "final_loss", "first_loss", "tokens_per_s", "mfu", "last_checkpoint", "error"],
    "metric": ["step", "loss", "lr", "tokens_per_s", "step_time_s", "mfu", "peak_mem_gb", "time"],
    "event": ["time", "kind", "name", "detail", "expect_s", "tag", "state", "bytes"],
}


def record(kind: str) -> st.SearchStrategy:
    """A record with gpuctl's own field names and any values, or any JSON at all."""
    return st.fixed_dictionaries({}, optional={k: JSON for k in KEYS[kind]}) | JSON


FORBIDDEN = {chr(c) for c in [*range(9), *range(11, 32), *range(0x7F, 0xA0)]}


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    status=record("status"),
    summary=record("summary"),
    metrics=st.lists(record("metric"), max_size=3),
    events=st.lists(record("event"), max_size=3),
)
def test_any_json_from_the_node_neither_crashes_nor_reaches_the_record_or_terminal(
    status, summary, metrics, events, capsys
):
    with tempfile.TemporaryDirectory() as tmp:
        lines = lambda rows: "".join(json.dumps(r) + "\n" for r in rows)  # noqa: E731
        run = run_with_files(
            Path(tmp),
            {
                "status.json": json.dumps(status),
                "summary.json": json.dumps(summary),
                "metrics.jsonl": lines(metrics),
                "events.jsonl": lines(events),
                "job.log": "Traceback: \x1b]0;title\x07boom\n",
            },
        )
        st_ = WatchState(RunInfo.of(run))
        update = Feed(run).poll(LocalNode())
        st_.apply(update)
        assert 0 <= job.exit_code_of(update.status) <= 255
        state.load_run(run.run_id)  # what was stored still loads
        PlainSink().update(st_, update)
        console = Console(file=StringIO(), force_terminal=False, width=140)
        console.print(live.screen(st_, 0.0))
        console.print("\n".join(summary_lines(st_)))
        shown = capsys.readouterr().out + console.file.getvalue()
        assert not FORBIDDEN & set(shown), repr(shown)


# --- sizes --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("over", ["local", "ssh"])
def test_a_huge_status_json_is_not_read(tmp_path, over, request):
    run = run_with_files(tmp_path / "run", {})
    with open(tmp_path / "run" / "status.json", "wb") as fh:
        fh.truncate(64 << 20)  # sparse: 64 MiB of NULs on disk for free
    if over == "ssh":
        sshd = request.getfixturevalue("sshd")
        node = SSHNode("127.0.0.1", sshd.port, sshd.user, str(sshd.client_key), pin_new=True)
        node.home()
    else:
        node = LocalNode()
    tracemalloc.start()
    try:
        status = job.read_status(run, node)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        node.close()
    assert peak < 4 << 20, peak
    assert any("status.json on the node is 67,108,864 bytes" in n and "not read" in n for n in status.notes)


def test_job_log_is_read_in_bounded_pieces_and_every_line_comes_out(project, monkeypatch):
    local_cluster(project)
    text = "".join(f"line {i} " + "x" * 200 + "\n" for i in range(20_000))  # ~4 MB
    run = run_with_files(project / "run", {"job.log": text, "status.json": '{"state": "succeeded", "exit_code": 0}'})
    monkeypatch.setattr(nodedata, "READ_BYTES", 64 << 10)
    reads: list[int] = []
    real = LocalNode.read_new

    def counted(self, path, offset, limit=nodedata.READ_BYTES):
        got = real(self, path, offset, limit)
        reads.append(got[1] - offset)
        return got

    monkeypatch.setattr(LocalNode, "read_new", counted)
    result = RUNNER.invoke(app, ["logs", run.run_id])
    assert result.exit_code == 0, result.output
    assert result.stdout == text
    assert max(reads) <= 64 << 10 and len(reads) > 50


def test_fetched_metrics_are_valid_records_only_and_bounded(project, monkeypatch):
    local_cluster(project)
    good = [json.dumps({"step": i, "loss": 1.0, "tokens_per_s": 10.0, "step_time_s": 0.1}) for i in range(4000)]
    bad = ['{"step": "x"}', "not json", '{"step": 1, "peak_mem_gb": "all"}', "[]"]
    lines = [line for i, g in enumerate(good) for line in ([g, bad[i % 4]] if i % 50 == 0 else [g])]
    run = run_with_files(project / "run", {"metrics.jsonl": "\n".join(lines) + "\n"})
    monkeypatch.setattr(nodedata, "MAX_COPY_BYTES", 64 << 10)
    monkeypatch.setattr(nodedata, "READ_BYTES", 16 << 10)
    said: list[str] = []
    copy = job.fetch_results(run, said.append) / "metrics.jsonl"
    kept = copy.read_text().splitlines()
    assert kept and all(nodedata.parse(nodedata.NodeMetric, line) for line in kept)
    assert copy.stat().st_size <= (64 + 16) << 10
    assert any("line(s) that are no valid record left out" in s for s in said)
    assert any("over 65,536 bytes; kept the first" in s for s in said)


# --- damaged records ------------------------------------------------------------------------------


def test_a_damaged_run_record_of_another_cluster_does_not_block_down(project, state_dir):
    local_cluster(project)
    other = state_dir / "runs" / "20260101-000000-othr.json"
    other.parent.mkdir(parents=True, exist_ok=True)
    other.write_text(json.dumps({"run_id": "20260101-000000-othr", "cluster": "other", "world_size": "pwn"}))
    result = RUNNER.invoke(app, ["down", "--yes"])
    assert result.exit_code == 0, result.output
    assert state.find_cluster("nd") is None and other.exists()


def test_a_damaged_cluster_record_does_not_block_up_of_another(project, state_dir):
    damaged = state_dir / "clusters" / "other.json"
    damaged.parent.mkdir(parents=True, exist_ok=True)
    damaged.write_text('{"name": "other", "provider": "vast", "nodes": [{"host": "node0", "port": "x"')
    (project / "gpuctl.yaml").write_text(yaml.safe_dump({"name": "nd", "storage": {"url": "./store"}}))
    result = RUNNER.invoke(app, ["up", "--skip-doctor"])
    assert result.exit_code == 0, result.output
    assert state.find_cluster("nd") is not None and damaged.exists()
    line = one_error_line(RUNNER.invoke(app, ["status", "--cluster", "other"]))
    assert "delete it" not in line and "gpuctl down" in line  # its own commands say so, without orphaning


@pytest.fixture
def vast(sshd, monkeypatch):
    yield from serve_vast(sshd, monkeypatch)


@pytest.mark.parametrize("damage", ["a field", "truncated"])
def test_down_of_a_damaged_rented_cluster_terminates_what_the_vendor_lists(project, vast, tmp_path, damage):
    write_config(project, {"kind": "vast", "api_url": vast.url, **node_fields(tmp_path)}, name="hurt")
    record = cluster.up(load_config(project / "gpuctl.yaml"), UpOptions(assume_yes=True, say=lambda _: None))
    assert record is not None and len(vast.instances) == 1
    path = state.cluster_file("hurt")
    raw = path.read_text()
    if damage == "a field":
        doc = json.loads(raw)
        doc["nodes"][0]["port"] = "pwn"
        path.write_text(json.dumps(doc))
    else:
        path.write_text(raw[:40])  # not even the provider is left: the config says vast
    line = one_error_line(RUNNER.invoke(app, ["status"]))
    assert "delete it" not in line and "gpuctl down" in line
    result = RUNNER.invoke(app, ["down", "--yes"])
    assert result.exit_code == 0, result.output
    assert not vast.instances and vast.deleted == [int(record.nodes[0].instance_id)]
    assert not path.exists()
    assert "terminated 1 vast instance(s)" in result.stderr


def test_down_of_a_damaged_record_of_your_own_machine_stays_an_error_that_changes_nothing(project, state_dir):
    local_cluster(project)
    path = state.cluster_file("nd")
    doc = json.loads(path.read_text())
    doc["nodes"][0]["slots"] = "many"
    path.write_text(json.dumps(doc))
    line = one_error_line(RUNNER.invoke(app, ["down", "--yes"]))
    assert "nodes.0.slots" in line and "rents no machine" in line
    assert path.exists()


def test_a_value_that_does_not_fit_is_never_written_into_a_record(project):
    local_cluster(project)
    run = saved_run("nd", RUN_ID)
    with pytest.raises(Exception, match="exit_code"):
        state.update_run(run.run_id, exit_code="pwn")
    assert state.load_run(run.run_id).exit_code is None  # the file is untouched: it still loads


def test_a_damaged_run_record_of_a_rented_cluster_does_not_keep_its_nodes(project, vast, tmp_path, state_dir):
    write_config(project, {"kind": "vast", "api_url": vast.url, **node_fields(tmp_path)}, name="runs")
    cluster.up(load_config(project / "gpuctl.yaml"), UpOptions(assume_yes=True, say=lambda _: None))
    damaged = state_dir / "runs" / "20260101-000000-hurt.json"
    damaged.parent.mkdir(parents=True, exist_ok=True)
    damaged.write_text(json.dumps({"run_id": "20260101-000000-hurt", "cluster": "runs", "pgid": "pwn"}))
    said: list[str] = []
    assert cluster.down("runs", say=said.append)
    assert not vast.instances and state.find_cluster("runs") is None
    assert any("terminating the cluster's nodes ends its run" in s for s in said)

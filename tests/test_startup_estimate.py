"""`up`'s first-step estimate (provision/estimate/startup.py) and the figures it reads: each pinned image's
size, each pin's wheel size; the phases the summary puts beside it (flows/startup_phases.py)."""

from __future__ import annotations

import time

import pytest
import yaml

from provision.core import state
from provision.estimate.startup import RATES, StartupInput, beside, estimate_line, first_step, total_s
from provision.estimate.wheel_sizes import WHEEL_MB, install_mb, pins
from provision.flows import job
from provision.flows.watch import RunInfo, Update, WatchState
from provision.providers.bootstrap import images_dir, pin_texts
from provision.providers.startup_input import model_bytes
from provision.providers.vendor_images import BOOTSTRAP_IMAGES, IMAGE_SIZES

SEVEN_B = model_bytes("deepseek-ai/deepseek-llm-7b-base")
MISSION = StartupInput(image_gb=10.0, wheels_mb=130.0, sdist_builds=1, ops="unknown", model_bytes=SEVEN_B)


def terms_of(inp: StartupInput) -> dict[str, float]:
    return {t.name: t.seconds for t in first_step(inp)}


def test_the_mission_estimate_has_every_phase_and_a_plausible_total():
    t = terms_of(MISSION)
    assert list(t) == ["image pull", "node-side install", "ops", "model download"]
    assert 13.5e9 < SEVEN_B < 14.2e9  # 6.9 B parameters in bf16
    assert t["ops"] == RATES.compile_s[0]  # not checked: counted as a compile
    assert 5 * 60 < total_s(first_step(MISSION)) < 30 * 60


def test_it_grows_with_the_model_size():
    small, big = (terms_of(StartupInput(image_gb=10.0, model_bytes=b)) for b in (1e9, 2 * SEVEN_B))
    assert big["model download"] > 10 * small["model download"]
    assert total_s(first_step(StartupInput(image_gb=10.0, model_bytes=2 * SEVEN_B))) > total_s(
        first_step(StartupInput(image_gb=10.0, model_bytes=SEVEN_B))
    )
    assert "model download" not in terms_of(StartupInput(image_gb=10.0, model_bytes=0))  # tiny: nothing


def test_a_cache_hit_removes_the_compile_term():
    miss = terms_of(StartupInput(image_gb=10.0, ops="miss"))["ops"]
    hit = terms_of(StartupInput(image_gb=10.0, ops="hit"))["ops"]
    assert miss == RATES.compile_s[0] and hit < 10
    assert terms_of(StartupInput(image_gb=10.0, ops="prebuilt"))["ops"] == 0


def test_an_image_cached_by_the_host_costs_only_the_vendor_start():
    cached = terms_of(StartupInput(image_gb=10.0, image_cached=True))["image pull"]
    pulled = terms_of(StartupInput(image_gb=10.0))["image pull"]
    assert cached == RATES.vendor_start_s[0] and pulled > cached + 60
    # an image gpuctl has no size for: the pull is not counted, and the line says so
    unknown = first_step(StartupInput(image_gb=None))[0]
    assert unknown.seconds == RATES.vendor_start_s[0] and "size unknown" in unknown.basis


def test_the_hosts_own_download_speed_replaces_the_default():
    slow = terms_of(StartupInput(image_gb=10.0, model_bytes=SEVEN_B, download_mbps=100))
    fast = terms_of(StartupInput(image_gb=10.0, model_bytes=SEVEN_B, download_mbps=2000))
    assert slow["model download"] > 10 * fast["model download"]
    assert slow["image pull"] > fast["image pull"]  # fast is bounded by the layers' unpacking instead


def test_the_line_names_the_total_and_each_term():
    line = estimate_line(first_step(MISSION))
    assert line.startswith("first step in ~") and " min (" in line
    for name in ("image pull", "node-side install", "ops", "model download", "counted as a miss"):
        assert name in line


def test_every_pinned_image_has_a_size_with_its_source():
    for image in set(BOOTSTRAP_IMAGES.values()):
        size, source = IMAGE_SIZES[image]
        assert 1 < size < 40 and len(source) > 40


def test_every_pin_but_torch_has_a_wheel_size():
    for flavour in ("cuda", "cpu"):
        names = [p for text in pin_texts(flavour).values() for p in pins(text) if not p.startswith("torch==")]
        assert names and all(p in WHEEL_MB for p in names), [p for p in names if p not in WHEEL_MB]
    total, unknown = install_mb([(images_dir() / "requirements-train.txt").read_text(), "foo==1.0\n"])
    assert unknown == ["foo==1.0"] and total > WHEEL_MB["pyarrow==26.0.1"]


def test_the_summary_puts_measured_beside_estimated():
    lines = beside(
        {"image pull": 300.0, "ops": 110.0}, {"image pull": 250.0, "ops": 2.0}, {"ops": "cpu_adam cache hit"}
    )
    assert lines == [
        "    image pull: 250 s (estimate 300 s)",
        "    ops: 2 s, cpu_adam cache hit (estimate 110 s)",
    ]


@pytest.fixture
def booted(state_dir):
    """A vast cluster whose `up` measured and estimated its phases, and its first run."""
    now = time.time() - 1000
    node = state.NodeRecord(host="node0", boot_s=240.0, install_s=95.0)
    cluster = state.ClusterRecord(
        name="c",
        provider="vast",
        nodes=[node],
        created_at=now,
        image="pytorch/pytorch:x",
        startup_estimate={"image pull": 300.0, "node-side install": 120.0, "ops": 110.0, "model download": 250.0},
    )
    state.save_cluster(cluster)
    run = state.RunRecord(
        run_id="r1",
        cluster="c",
        created_at=now + 400,
        run_dir="/x",
        bundle_dir=str(state_dir / "b"),
        world_size=1,
        train_batch_size=1,
        micro_batch=1,
        grad_accum=1,
        max_steps=1,
    )
    state.save_run(run)
    return cluster, run


def test_the_first_runs_view_and_summary_show_ups_phases_and_the_ops_outcome(booted):
    from provision.cli.run_text import phase_text, summary_lines
    from provision.flows.watch import Feed

    cluster, run = booted
    setup = Feed(run).setup
    assert [e["name"] for e in setup] == ["image pull", "node-side install"]
    assert phase_text(setup[0]).endswith("took 240 s")
    t = cluster.created_at + 400
    events = [
        *setup,
        {"kind": "phase", "name": "ops", "detail": "cpu_adam", "time": t},
        {"kind": "outcome", "name": "ops", "detail": "cpu_adam cache hit", "time": t + 3},
        {"kind": "phase", "name": "model download", "detail": "m", "time": t + 3},
    ]
    status = job.RunStatus(run, "succeeded", 0, {"started_at": t, "ended_at": t + 300}, {}, {}, [], None)
    st = WatchState(RunInfo.of(run))
    st.apply(Update(status, [], [{"step": 1, "time": t + 203}], events))
    assert [(p.name, round((p.ended or 0) - p.started)) for p in st.phases] == [
        ("image pull", 240),
        ("node-side install", 95),
        ("ops", 3),
        ("model download", 200),
    ]
    text = "\n".join(summary_lines(st))
    assert "before the first step: 538 s measured (up's estimate 780 s)" in text
    assert "    image pull: 240 s (estimate 300 s)" in text
    assert "    ops: 3 s, cpu_adam cache hit (estimate 110 s)" in text
    assert "    model download: 200 s (estimate 250 s)" in text


def test_a_later_run_on_the_cluster_shows_only_its_own_phases(booted):
    from provision.flows.startup_phases import status_lines
    from provision.flows.watch import Feed

    cluster, first = booted
    later = first.model_copy(update={"run_id": "r2", "created_at": first.created_at + 600})
    state.save_run(later)
    assert Feed(later).setup == []
    lines = status_lines(later, {"phases": {"ops": 1.5, "first step": 4.0}, "phase_notes": {"ops": "cpu_adam on node"}})
    assert lines == ["  before the first step: 6 s measured", "    other phases (tokenizing, ranks, DeepSpeed): 6 s"]
    lines = status_lines(first, {"phases": {"ops": 2.0}, "phase_notes": {"ops": "cpu_adam cache hit"}})
    assert "    node-side install: 95 s (estimate 120 s)" in lines
    assert "    ops: 2 s, cpu_adam cache hit (estimate 110 s)" in lines
    assert "    model download: not measured (estimate 250 s)" in lines


def test_up_looks_for_the_op_cache_entry_in_the_bucket(s3_server, fresh_bucket, tmp_path):
    from provision.core.config import load_config
    from provision.providers.startup_input import bucket_has_ops

    path = tmp_path / "gpuctl.yaml"
    storage = {"url": f"s3://{fresh_bucket}/runs", "endpoint_url": s3_server.endpoint}
    path.write_text(yaml.safe_dump({"name": "t", "storage": storage}))
    cfg = load_config(path)
    assert bucket_has_ops(cfg) == "miss"
    put = s3_server.client().put_object
    put(
        Bucket=fresh_bucket,
        Key="runs/_ops/cpu_adam-torch2.10.0_cu128-ds0.19.8-cuda12.9-py3.12-x86-64-v3.json",
        Body=b"{}",
    )
    assert bucket_has_ops(cfg) == "miss"  # another CUDA's build
    put(
        Bucket=fresh_bucket,
        Key="runs/_ops/cpu_adam-torch2.10.0_cu128-ds0.19.8-cuda12.8-py3.12-x86-64-v3.json",
        Body=b"{}",
    )
    assert bucket_has_ops(cfg) == "hit"
    unreachable = {**storage, "endpoint_url": "http://127.0.0.1:9"}
    path.write_text(yaml.safe_dump({"name": "t", "storage": unreachable}))
    assert bucket_has_ops(load_config(path)) == "unknown"  # not checked: counted as a miss, and said

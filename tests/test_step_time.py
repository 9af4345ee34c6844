"""Plan's step-time model (provision/estimate/step_time.py) and the doctor's speed figures it reads.

The terms add up to the step; every rate of a calibrated model comes from the doctor's JSON (recorded on
this machine's CPU ranks, tests/data/doctor_rates/README.md); the GPU copy figures are parsed and judged
from a file in the shape the node prints; CPU Adam and the disk's write rate are measured here for real.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from provision.cli.app import app
from provision.core import state
from provision.core.checks import DoctorResult
from provision.estimate.doctor import judge
from provision.estimate.doctor_rows import Needs
from provision.estimate.doctor_speed import raw_rates
from provision.estimate.forecast import compare, compare_lines, measured_means
from provision.estimate.plan import plan
from provision.estimate.plan_input import PlanInput
from provision.estimate.rates import flops_per_micro
from provision.estimate.step_time import model_to_json, predict
from tests.test_cli_plan import SEED_7B, plan_json

DATA = Path(__file__).parent / "data" / "doctor_rates"
CPU = json.loads((DATA / "cpu-3ranks-tiny-seq128.json").read_text())
TINY = PlanInput(model="tiny", gpus_per_node=3, micro_batch=1, seq_len=128, grad_accum=1, precision="fp32",
                 gradient_checkpointing=False)  # fmt: skip


def test_the_terms_add_up_to_the_step_and_the_bound_is_the_largest():
    for strategy in ("deepspeed", "fsdp"):
        result = plan(PlanInput(model="deepseek-7b", gpus_per_node=3, grad_accum=4, strategy=strategy))
        model = predict(result, checkpoint_every=100)
        assert model.step_s == pytest.approx(sum(t.seconds for t in model.terms))
        assert model.fast_s == pytest.approx(sum(t.fast_s for t in model.terms)) and model.fast_s < model.step_s
        assert model.slow_s == pytest.approx(sum(t.slow_s for t in model.terms)) and model.slow_s > model.step_s
        assert model.bound.seconds == max(t.seconds for t in model.terms)
        assert model.tokens_per_s == pytest.approx(3 * 4 * 2048 / model.step_s)
        for t in model.terms:  # each a count over a rate
            if t.seconds and t.rate.unit != "s":
                assert t.fast_s == pytest.approx(t.amount / t.rate.high) and t.slow_s == pytest.approx(
                    t.amount / t.rate.low
                )
        out = model_to_json(model)
        assert out["bound"] == model.bound.name and [t["name"] for t in out["terms"]] == [t.name for t in model.terms]
        assert out["step_s"] == pytest.approx(sum(t["seconds"] for t in out["terms"]), rel=1e-4)
        assert not model.measured  # no doctor: every rate from the tables


def test_every_rate_of_the_calibrated_model_comes_from_the_doctors_json():
    raw = raw_rates(CPU)
    model = predict(plan(TINY), accelerator="cpu", doctor={"cpu-node": raw}, checkpoint_every=10)
    by = {t.name: t for t in model.terms}
    for t in model.terms:
        if t.seconds > 0:
            assert t.rate.source.startswith("doctor on cpu-node"), (t.name, t.rate.source)
    assert by["offload d2h"].seconds == 0 and by["offload h2d"].seconds == 0  # CPU ranks copy nothing
    comp, red = CPU["rates"]["compute"], CPU["rates"]["compute"]["reduce"]
    flops = flops_per_micro(plan(TINY).model, 1, 128, False)
    assert by["compute"].seconds == pytest.approx(comp["seconds"])  # the measured micro-step, at its own shape
    assert by["compute"].rate.mid == pytest.approx(flops / comp["seconds"])
    assert by["grad reduce"].rate.mid == pytest.approx(red["bytes"] / red["seconds"])
    assert by["param gather"].rate.mid == pytest.approx(red["bytes"] / red["gather_s"])
    adam = CPU["rates"]["cpu_adam"]
    assert by["cpu adam"].rate.mid == pytest.approx(adam["params"] / adam["seconds"])
    assert by["framework/micro"].seconds == pytest.approx(CPU["rates"]["engine"]["micro_s"])
    assert by["framework/step"].seconds == pytest.approx(CPU["rates"]["engine"]["step_s"])
    assert by["checkpoint"].rate.mid == pytest.approx(CPU["rates"]["disk"]["bytes_per_s"])
    assert model.slow_s / model.fast_s <= 1.6  # a calibrated prediction's range


def test_the_slowest_node_sets_each_rate_and_odd_figures_are_not_measured():
    slow = json.loads(json.dumps(CPU))
    slow["rates"]["cpu_adam"]["seconds"] *= 4
    model = predict(plan(TINY), accelerator="cpu", doctor={"a": raw_rates(CPU), "b": raw_rates(slow)})
    adam = next(t for t in model.terms if t.name == "cpu adam")
    assert adam.rate.source.startswith("doctor on b")
    odd = {"rates": {"cpu_adam": {"params": "many", "seconds": float("nan")}, "disk": {"bytes_per_s": -1},
                     "engine": {"micro_s": True}, "compute": {"seconds": 1e400}}}  # fmt: skip
    assert raw_rates(odd) == {"cpu_adam": {}, "disk": {}, "engine": {}, "compute": {}}
    table = predict(plan(TINY), accelerator="cpu", doctor={"x": raw_rates(odd)})
    assert not table.measured and all("assumed" in t.rate.source or t.seconds == 0 for t in table.terms)


def test_gpu_copy_figures_are_parsed_judged_and_used_pinned_or_pageable():
    needs = Needs(ranks=3, accelerator="cuda", offload=True, quick=False)
    rows = {r.check: r for r in judge("g0", json.loads((DATA / "rtx4090-copy.json").read_text()), needs)}
    assert rows["host<->device copy (pinned)"].status == "pass"
    assert rows["host<->device copy (pinned)"].value == "h2d 23.9 GB/s, d2h 26.6 GB/s"
    assert rows["host<->device copy (pageable)"].status == "pass"
    assert rows["disk write rate"].status == "pass" and "1,491 MB/s" in rows["disk write rate"].value
    narrow = {r.check: r for r in judge("g0", json.loads((DATA / "rtx4090-copy-x8.json").read_text()), needs)}
    assert (
        narrow["host<->device copy (pinned)"].status == "warn" and "PCIe" in narrow["host<->device copy (pinned)"].fix
    )
    raw = raw_rates(json.loads((DATA / "rtx4090-copy.json").read_text()))
    base = dict(model="deepseek-7b", gpus_per_node=3, grad_accum=4)
    for pinning, gbs in (("exact", 26.6), ("off", 12.3)):
        model = predict(plan(PlanInput(**base, pinning=pinning)), doctor={"g0": raw})
        d2h = next(t for t in model.terms if t.name == "offload d2h")
        assert d2h.rate.source.startswith("doctor on g0") and d2h.rate.mid == pytest.approx(gbs * 1e9, rel=1e-3)
        compute = next(t for t in model.terms if t.name == "compute")
        assert "RTX 4090 peak" in compute.rate.source  # not measured there: the table, and it says so


def test_cpu_adam_and_the_disk_rate_are_measured_on_this_cpu(tmp_path, monkeypatch):
    from trainer.doctor_rates import disk_write, measure

    disk = disk_write(str(tmp_path / "not-yet" / "made"), 16)  # a workdir `up` has not made: its parent
    assert disk["path"] == str(tmp_path) and disk["bytes"] == 16 << 20 and disk["bytes_per_s"] > 1e6
    assert list(tmp_path.iterdir()) == []  # the probe file is gone
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    facts = {"rates": {"disk": disk, **measure({"ranks": 1, "accelerator": "cpu", "adam_params": 2_000_000})}}
    adam = facts["rates"]["cpu_adam"]
    assert adam["params"] == 2_000_000 and 0 < adam["seconds"] < 5 and adam["threads"] == 1
    rows = {r.check: r for r in judge("local", facts, Needs(ranks=1, accelerator="cpu", offload=True, quick=False))}
    assert (
        rows["CPU Adam throughput"].status in ("pass", "warn")
        and "M params/s per rank" in rows["CPU Adam throughput"].value
    )
    assert rows["host<->device copy"].status == "n/a"
    model = predict(
        plan(PlanInput(model="tiny", gpus_per_node=1)),
        accelerator="cpu",
        doctor={"local": raw_rates(facts)},
        checkpoint_every=10,
    )
    assert {"cpu adam", "checkpoint"} <= set(model.measured)


def test_plan_prints_the_terms_and_uses_the_clusters_doctor_figures(project):
    (project / "gpuctl.yaml").write_text(SEED_7B + "name: seven\n")
    before = plan_json()["step_time"]
    assert before["measured_terms"] == [] and before["bound"] in [t["name"] for t in before["terms"]]
    raw = raw_rates(json.loads((DATA / "rtx4090-copy.json").read_text()))
    node = state.NodeRecord(host="n0", slots=3, accelerator="cuda", gpu_name="NVIDIA GeForce RTX 4090")
    state.save_cluster(
        state.ClusterRecord(name="seven", provider="vast", nodes=[node], doctor=DoctorResult(rates={"n0": raw}))
    )
    after = plan_json()["step_time"]
    assert {"offload d2h", "offload h2d", "checkpoint"} <= set(after["measured_terms"])
    d2h = next(t for t in after["terms"] if t["name"] == "offload d2h")
    assert d2h["source"].startswith("doctor on n0") and math.isclose(d2h["rate"]["low"] * 1.15, 26.6e9, rel_tol=1e-3)
    text = CliRunner().invoke(app, ["plan"], env={"COLUMNS": "250"}).stdout
    assert "(bound)" in text and "predicted: step" in text and "measured on the node: offload d2h" in text


def test_predicted_and_measured_side_by_side():
    model = predict(plan(TINY), accelerator="cpu", doctor={"n": raw_rates(CPU)}, checkpoint_every=5)
    records = [
        {"step": i, "step_time_s": 0.5 if i == 1 else 0.06, "fwd_bwd_s": 0.045, "optimizer_s": 0.011} for i in (1, 2, 3)
    ]
    seen = measured_means(records, [0.04, 0.05])
    assert seen == pytest.approx({"step_time_s": 0.06, "fwd_bwd_s": 0.045, "optimizer_s": 0.011, "save_s": 0.045})
    rows = {part: (pred, got) for part, pred, got in compare(model_to_json(model), seen)}
    by = {t.name: t.seconds for t in model.terms}
    assert rows["step (saves apart)"][0] == pytest.approx(model.step_s - by["checkpoint"], rel=1e-4)
    assert rows["forward+backward"][0] + rows["optimizer step"][0] == pytest.approx(
        rows["step (saves apart)"][0], rel=1e-4
    )
    assert rows["checkpoint save (one)"][0] == pytest.approx(by["checkpoint"] * 5, rel=1e-4)
    lines = compare_lines(model_to_json(model), seen)
    assert lines[0].split() == ["part", "predicted", "measured", "ratio"] and len(lines) == 5


def test_the_uploads_cpu_cost_is_measured_against_a_real_s3_server(s3_server, fresh_bucket):
    """The doctor's larger storage object also says what the put cost in CPU-seconds: plan's upload term."""
    from provision.estimate.rates import node_rates
    from trainer.doctor import storage_facts

    facts = storage_facts({"url": f"s3://{fresh_bucket}/runs/doc", "endpoint_url": s3_server.endpoint}, {}, 16)
    assert facts["large_ok"] and 0 < facts["put_cpu_s"] < 60, facts
    raw = raw_rates({"rates": {"upload": {"bytes": 16 << 20, "cpu_s": facts["put_cpu_s"]}}})
    rate = node_rates(raw, None, "local")["upload_cpu"]
    assert rate.mid == pytest.approx((16 << 20) / facts["put_cpu_s"]) and rate.source.startswith("doctor on local")
    offload = predict(plan(TINY), accelerator="cpu", doctor={"local": raw}, checkpoint_every=10)
    term = next(t for t in offload.terms if t.name == "upload cpu")
    assert term.seconds > 0 and term.rate == rate and "upload cpu" in offload.measured
    no_offload = plan(PlanInput(model="tiny", gpus_per_node=3, offload_optimizer="none"))
    idle = next(t for t in predict(no_offload, checkpoint_every=10).terms if t.name == "upload cpu")
    assert idle.seconds == 0  # the uploader takes cores the ranks leave idle

"""`gpuctl plan` says what a checkpoint save costs: size on the node and in the store, upload time at a given
or doctor-measured bandwidth, a warning when saves outrun uploads, and the node disk for keep_local.
(The size against a real DeepSpeed save of the tiny model: tests/test_trainer_end_of_run.py.)"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from provision.cli.app import app
from provision.core import state
from provision.core.checks import CheckRow, DoctorResult
from provision.estimate.checkpoint_cost import checkpoint_cost, save_bytes
from provision.estimate.hardware import KNOWN_MODELS
from provision.estimate.plan import plan
from provision.estimate.plan_input import PlanInput
from tests.test_cli_plan import plan_json

runner = CliRunner()
SEED_7B = """
provider: {kind: vast, gpu: RTX 4090, gpus_per_node: 3}
train: {model: deepseek-ai/deepseek-llm-7b-base, precision: fp16, zero_stage: 2, offload_optimizer: cpu,
        checkpoint_every: 50, keep_local: 2}
"""


def test_a_7b_zero2_save_is_weights_plus_adam_states_and_three_saves_of_disk(project):
    """DeepSeek-7B, ZeRO-2 on 3 GPUs: 2 B/param of fp16 weights + 12 B/param of fp32 master, m and v (~97 GB)."""
    (project / "gpuctl.yaml").write_text(SEED_7B)
    cost = plan_json("--upload-mbps", "120")["checkpoint"]
    params = KNOWN_MODELS["deepseek-7b"].params
    assert cost["node_bytes"] == cost["store_bytes"] == pytest.approx(14 * params, rel=1e-4)
    assert 96 < cost["store_gb"] < 98 and cost["upload_source"] == "--upload-mbps"
    assert cost["upload_s"] == pytest.approx(cost["node_bytes"] / 120e6, rel=1e-3)  # ~13 minutes
    assert cost["disk_gb"] == pytest.approx(3 * cost["node_gb"], rel=1e-3)  # keep_local 2 + the one being written
    assert cost["checkpoint_every"] == 50


def test_saves_that_outrun_uploads_are_warned_with_the_checkpoint_every_that_keeps_up(project):
    (project / "gpuctl.yaml").write_text(SEED_7B)
    lagging = plan_json("--upload-mbps", "50")["checkpoint"]
    assert lagging["piles_up"] is True and "uploads pile up" in lagging["warning"]
    keeps_up = lagging["keeps_up_checkpoint_every"]
    assert f"checkpoint_every >= {keeps_up}" in lagging["warning"] and keeps_up > 50
    fine = plan_json("--upload-mbps", "50", "--checkpoint-every", str(keeps_up))["checkpoint"]
    assert fine["piles_up"] is False and fine["warning"] is None
    assert plan_json("--checkpoint-every", "0")["checkpoint"]["piles_up"] is False  # only the final save
    text = runner.invoke(app, ["plan", "--upload-mbps", "50"])
    assert text.exit_code == 0 and "uploads pile up" in text.stdout and "size in the store" in text.stdout


def test_the_upload_bandwidth_comes_from_the_clusters_last_doctor_run(project):
    (project / "gpuctl.yaml").write_text(SEED_7B + "name: seven\n")
    assert "assumed" in plan_json()["checkpoint"]["upload_source"]
    rows = [
        CheckRow(check="storage throughput (256 MB)", node=n, value=f"put {put} MB/s, get 300 MB/s", status="pass")
        for n, put in (("n0", "1,180"), ("n1", "240"))
    ]
    node = state.NodeRecord(host="n0")
    state.save_cluster(state.ClusterRecord(name="seven", provider="vast", nodes=[node], doctor=DoctorResult(rows=rows)))
    cost = plan_json()["checkpoint"]
    assert cost["upload_mbps"] == 240 and "gpuctl doctor" in cost["upload_source"]  # the slowest node's put
    assert plan_json("--upload-mbps", "10")["checkpoint"]["upload_mbps"] == 10  # the flag wins


def test_zero3_and_fsdp_partition_everything_and_split_it_over_nodes():
    two_nodes = dict(model="deepseek-7b", gpus_per_node=4, nodes=2, gpu="A100", precision="bf16")
    params = KNOWN_MODELS["deepseek-7b"].params
    z3_node, z3_store = save_bytes(plan(PlanInput(zero_stage=3, **two_nodes)))
    assert z3_store == pytest.approx(12 * params, rel=1e-3) and z3_node == pytest.approx(z3_store / 2, rel=1e-3)
    fsdp = plan(PlanInput(zero_stage=2, **two_nodes))
    f_node, f_store = save_bytes(fsdp, "fsdp")
    assert f_store == pytest.approx(12 * params, rel=1e-2) and f_node == pytest.approx(f_store / 2, rel=1e-3)
    z2_node, z2_store = save_bytes(fsdp)  # ZeRO-2: node 0 also writes the 16-bit weights
    assert z2_store == pytest.approx(14 * params, rel=1e-3) and z2_node == pytest.approx(8 * params, rel=1e-3)
    assert checkpoint_cost(fsdp, 0, 100.0, "test").upload_s == pytest.approx(z2_node / 100e6)

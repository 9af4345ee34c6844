"""`gpuctl plan` through the CLI: reads gpuctl.yaml, takes overrides, --json for scripts."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from provision.cli.app import app

runner = CliRunner()
SEED_7B = """
provider: {kind: vast, gpu: RTX 4090, gpus_per_node: 3}
train: {model: deepseek-ai/deepseek-llm-7b-base, precision: fp16, seq_len: 2048,
        gradient_checkpointing: true, zero_stage: 2, offload_optimizer: cpu}
"""


def plan_json(*args: str) -> dict:
    result = runner.invoke(app, ["plan", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_plan_reads_the_runs_config_and_overrides(project):
    (project / "gpuctl.yaml").write_text(SEED_7B)
    fits = plan_json()
    assert fits["fits"] is True and 13.8 <= fits["gpu_gb_per_rank"] <= 24 and fits["host_ram_gb"] > 100
    no_offload = plan_json("--offload", "none")
    assert no_offload["fits"] is False and no_offload["gpu_gb_per_rank"] > 24
    bigger = plan_json("--gpu-mem", "80", "--offload", "none", "--gpus", "8", "--zero-stage", "3")
    assert bigger["input"]["gpus_per_node"] == 8 and bigger["fits"] is True


def test_plan_without_config_is_the_seed_setup(project):
    result = runner.invoke(app, ["plan"])
    assert result.exit_code == 0
    assert "14 GB" in result.stdout and "FITS" in result.stdout


def test_plan_bad_flag_is_one_line(project):
    result = runner.invoke(app, ["plan", "--model", "gpt-9"])
    assert result.exit_code == 2 and result.stderr.startswith("error: ") and "Traceback" not in result.stderr
    # PlanInput's PlanError (provision.estimate.hardware) reaches the boundary as a config error with its fix
    assert "unknown model 'gpt-9'" in result.stderr and "fix the flag or gpuctl.yaml value it names" in result.stderr

"""provision.estimate.plan: DeepSpeed estimator parity, DeepSeek-7B on 3x4090 verdicts, JSON shape, gpu_check paths."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from provision.cli.views import plan_table
from provision.estimate.hardware import (
    KNOWN_MODELS,
    ModelDims,
    PlanError,
    find_gpu,
    zero2_model_states_mem,
    zero3_model_states_mem,
)
from provision.estimate.plan import plan, plan_to_json
from provision.estimate.plan_input import PlanInput

ROOT = Path(__file__).resolve().parents[1]
DEEPSEEK = dict(
    model="deepseek-7b",
    gpus_per_node=3,
    nodes=1,
    micro_batch=1,
    seq_len=2048,
    gradient_checkpointing=True,
    precision="fp16",
    gpu="RTX 4090",
    gpu_mem_gb=24,
)
PARAM_COUNTS = [1_000_003, 124_439_808, 1_300_000_000, 6_910_365_696, 70_553_706_496]
GPU_LAYOUTS = [(1, 1), (2, 1), (3, 1), (4, 2), (8, 3)]


@pytest.fixture(scope="module")
def ds_estimators():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    z2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    z3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    return z2.estimate_zero2_model_states_mem_needs, z3.estimate_zero3_model_states_mem_needs


@pytest.mark.parametrize("params", PARAM_COUNTS)
@pytest.mark.parametrize("gpus,nodes", GPU_LAYOUTS)
@pytest.mark.parametrize("offload", [True, False])
@pytest.mark.parametrize("factor", [1.0, 1.5])
def test_zero2_matches_deepspeed(ds_estimators, params, gpus, nodes, offload, factor):
    ds = ds_estimators[0](params, gpus, nodes, offload, factor)
    assert zero2_model_states_mem(params, gpus, nodes, offload, factor) == ds


@pytest.mark.parametrize(
    "params,largest", [(1_000_003, 65_536), (6_910_365_696, 419_430_400), (70_553_706_496, 1_050_673_152)]
)
@pytest.mark.parametrize("gpus,nodes", GPU_LAYOUTS)
@pytest.mark.parametrize("offload,offload_params", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("zero_init", [True, False])
def test_zero3_matches_deepspeed(ds_estimators, params, largest, gpus, nodes, offload, offload_params, zero_init):
    ds = ds_estimators[1](params, largest, gpus, nodes, offload, offload_params, zero_init, 1.5)
    assert zero3_model_states_mem(params, largest, gpus, nodes, offload, offload_params, zero_init, 1.5) == ds


@pytest.mark.parametrize(
    "stage,offload,offload_param",
    [(2, "cpu", "none"), (2, "none", "none"), (3, "cpu", "cpu"), (3, "cpu", "none"), (3, "none", "none")],
)
@pytest.mark.parametrize("gpus,nodes", [(1, 1), (3, 1), (4, 2)])
def test_plan_model_states_are_deepspeeds(ds_estimators, stage, offload, offload_param, gpus, nodes):
    """plan()'s GPU model states and host RAM are exactly DeepSpeed's figures, and its breakdown sums to them."""
    inp = PlanInput(
        **{**DEEPSEEK, "gpus_per_node": gpus, "nodes": nodes},
        zero_stage=stage,
        offload_optimizer=offload,
        offload_param=offload_param,
    )
    r = plan(inp)
    p, off = r.params, offload == "cpu"
    if stage == 2:
        cpu, gpu = ds_estimators[0](p, gpus, nodes, off, 1.5)
    else:
        cpu, gpu, _ = ds_estimators[1](
            p, KNOWN_MODELS["deepseek-7b"].largest_layer_params, gpus, nodes, off, offload_param == "cpu", True, 1.5
        )
    assert r.memory.model_states_bytes == gpu
    assert r.ds_host_ram_gb == cpu / 1e9
    parts = (r.memory.weights_gb + r.memory.grads_gb + r.memory.optimizer_gb) * 1e9
    assert parts == pytest.approx(gpu, abs=2)


def test_param_counts():
    assert KNOWN_MODELS["deepseek-7b"].params == 6_910_365_696  # = HF LlamaForCausalLM with these dims
    assert KNOWN_MODELS["deepseek-ai/deepseek-llm-7b-base"] == KNOWN_MODELS["deepseek-7b"]
    assert KNOWN_MODELS["deepseek-7b"].largest_layer_params == 102400 * 4096  # embed_tokens / lm_head
    tiny = KNOWN_MODELS["tiny"]
    assert (tiny.hidden, tiny.layers, tiny.heads, tiny.intermediate) == (128, 4, 4, 344)


def test_tiny_matches_the_trainers_tiny_model():
    torch = pytest.importorskip("torch")
    model_mod = pytest.importorskip("trainer.model")
    tokenizer_mod = pytest.importorskip("trainer.tokenizer")
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=len(tokenizer_mod.byte_tokenizer()), **model_mod.TINY_SHAPE)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    assert KNOWN_MODELS["tiny"].params == sum(t.numel() for t in model.parameters())


def test_peaks_agree_with_the_trainers_mfu_table():
    metrics = pytest.importorskip("trainer.metrics")
    for name in (
        "NVIDIA GeForce RTX 4090",
        "NVIDIA H200",
        "NVIDIA H100 80GB HBM3",
        "NVIDIA H100 PCIe",
        "NVIDIA A100-SXM4-80GB",
        "NVIDIA A10G",
        "NVIDIA L4",
    ):
        assert find_gpu(name).peak_tflops_16bit == metrics.peak_tflops(name), name


def test_param_count_matches_transformers():
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    dims = ModelDims("gqa", layers=2, hidden=256, heads=8, kv_heads=2, intermediate=688, vocab=1000)
    cfg = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=1000,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    assert dims.params == sum(t.numel() for t in model.parameters())


def test_deepseek_7b_zero2_offload_fits_on_3x4090():
    r = plan(PlanInput(**DEEPSEEK, offload_optimizer="cpu"))
    assert r.params == pytest.approx(6.91e9, rel=1e-3)
    assert r.fits and r.closest is None
    assert r.memory.weights_gb == pytest.approx(13.82, abs=0.01)  # full fp16 copy on every rank
    assert r.memory.grads_gb == 0 and r.memory.optimizer_gb == 0
    assert 13.82 < r.gpu_gb_per_rank < 24
    assert r.memory.activations_ckpt_gb < r.memory.activations_full_gb
    assert r.host_adam_states_gb == pytest.approx(16 * r.params / 1e9)
    assert r.ds_host_ram_gb == pytest.approx(16 * 1.5 * r.params / 1e9)
    assert 2000 < r.tokens_per_s_low < r.tokens_per_s_high < 4500
    assert r.flop_ceiling_tokens_per_s == pytest.approx(11_953, rel=1e-3)  # DESIGN.md: ~11,950 tokens/s


def test_deepseek_7b_why_lines_explain_the_14gb_floor():
    why = "\n".join(plan(PlanInput(**DEEPSEEK, offload_optimizer="cpu")).why)
    assert "13.8 GB" in why and "~14 GB" in why and "Floor" in why
    assert "every rank keeps a full fp16 copy of the parameters" in why
    assert "Only ZeRO-3 partitions the parameters" in why
    assert "Korthikanti" in why and "165.2" in why


def test_deepseek_7b_without_offload_does_not_fit_and_closest_does():
    r = plan(PlanInput(**DEEPSEEK, offload_optimizer="none"))
    assert not r.fits
    assert r.gpu_gb_per_rank > 24
    assert r.closest is not None and r.closest.fits
    assert r.closest.gpu_gb_per_rank <= 24
    assert r.closest_changes == ["offload_optimizer=cpu"]  # one knob, training math unchanged
    assert any(line.startswith("Closest config that fits: offload_optimizer=cpu") for line in r.why)


def test_without_checkpointing_the_search_turns_it_on():
    r = plan(PlanInput(**{**DEEPSEEK, "gradient_checkpointing": False}, offload_optimizer="cpu"))
    assert not r.fits and r.closest is not None and r.closest.fits
    assert r.closest.input.gradient_checkpointing


def test_search_reduces_micro_batch_and_seq_len_when_needed():
    r = plan(PlanInput(**{**DEEPSEEK, "micro_batch": 16, "seq_len": 8192}, offload_optimizer="cpu"))
    assert not r.fits and r.closest is not None and r.closest.fits
    assert r.closest.input.micro_batch < 16 or r.closest.input.seq_len < 8192


def test_nothing_fits_says_so():
    big = ModelDims("huge", layers=200, hidden=16384, heads=128, intermediate=53248, vocab=256000)
    r = plan(PlanInput(model=big, gpus_per_node=1, gpu="L4", zero_stage=2, offload_optimizer="none"))
    assert not r.fits and r.closest is None
    assert r.why[-1].startswith("Nothing fits")


def test_json_keys_and_roundtrip():
    d = plan_to_json(plan(PlanInput(**DEEPSEEK, offload_optimizer="none")))
    for key in (
        "gpu_gb_per_rank",
        "host_ram_gb",
        "fits",
        "params",
        "gpu_breakdown_gb",
        "tokens_per_s",
        "why",
        "closest",
        "closest_changes",
        "model_states_gpu_bytes",
        "peak_tflops",
        "peak_source",
    ):
        assert key in d
    assert d["fits"] is False and d["closest"]["fits"] is True
    assert {"weights", "grads", "optimizer", "activations", "buffers", "cuda_context"} <= set(d["gpu_breakdown_gb"])
    assert json.loads(json.dumps(d)) == d
    custom = plan_to_json(plan(PlanInput(model=KNOWN_MODELS["tiny"], gpus_per_node=1)))
    assert custom["input"]["model"]["hidden"] == 128


def test_render_table_has_breakdown():
    from rich.console import Console

    console = Console(record=True, width=140)
    console.print(plan_table(plan(PlanInput(**DEEPSEEK, offload_optimizer="cpu"))))
    text = console.export_text()
    assert "FITS" in text and "weights" in text and "13.82" in text and "activations" in text


def test_gpu_table():
    assert find_gpu("NVIDIA GeForce RTX 4090").peak_tflops_16bit == 165.2
    assert find_gpu("NVIDIA H200").peak_tflops_16bit == pytest.approx(989, abs=1)
    assert find_gpu("NVIDIA H100 80GB HBM3").peak_tflops_16bit == pytest.approx(989, abs=1)
    assert find_gpu("NVIDIA H100 PCIe").peak_tflops_16bit < 989
    assert find_gpu("NVIDIA A100-SXM4-40GB").mem_gb == 40 and find_gpu("A100").peak_tflops_16bit == 312
    assert find_gpu("NVIDIA L4").peak_tflops_16bit == 121 and find_gpu("NVIDIA A10G").peak_tflops_16bit == 125
    with pytest.raises(PlanError):
        find_gpu("Voodoo 2")


@pytest.mark.parametrize(
    "bad",
    [
        dict(zero_stage=4),
        dict(offload_optimizer="nvme"),
        dict(micro_batch=0),
        dict(zero_stage=0, offload_optimizer="cpu"),
        dict(model="gpt-5"),
        dict(zero_stage=2, offload_param="cpu"),
        dict(precision="int8"),
    ],
)
def test_invalid_inputs_raise_plan_error(bad):
    with pytest.raises(PlanError):
        PlanInput(**{"offload_optimizer": "cpu", **bad})


def test_all_stages_and_precisions_are_monotonic():
    """More partitioning or offload never needs more GPU memory."""
    gb = {
        (st, off): plan(
            PlanInput(**{**DEEPSEEK, "precision": "bf16"}, zero_stage=st, offload_optimizer=off)
        ).memory.model_states_bytes
        for st in (1, 2, 3)
        for off in ("none", "cpu")
    }
    assert gb[(1, "none")] > gb[(2, "none")] > gb[(3, "none")]
    assert all(gb[(st, "cpu")] < gb[(st, "none")] for st in (1, 2, 3))
    fp32 = plan(PlanInput(**{**DEEPSEEK, "precision": "fp32"}, offload_optimizer="cpu"))
    assert fp32.memory.weights_gb == pytest.approx(4 * fp32.params / 1e9)


def test_plan_module_never_imports_torch():
    tree = ast.parse((ROOT / "provision" / "estimate" / "plan.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"torch", "deepspeed", "transformers", "matplotlib"}


def test_gpu_check_fails_fast_without_cuda():
    """benchmarks/gpu_check.py on a machine without CUDA: one clear line, non-zero exit, no traceback."""
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--steps", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA device" in proc.stderr and "Traceback" not in proc.stderr


def test_gpu_check_plan_only_needs_no_torch():
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu_check.py"),
            "--plan-only",
            "--gpu",
            "NVIDIA H200",
            "--layers",
            "8",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "plan:" in proc.stdout and "GB" in proc.stdout

"""Step metrics: throughput, TFLOP/s and MFU, memory; job.log lines, metrics.jsonl, summary.json.

FLOPs per token = 6 x parameters (forward 2N + backward 4N; attention's extra FLOPs are
left out, as in the usual MFU convention). MFU = achieved FLOP/s per GPU / the GPU's peak
dense fp16/bf16 tensor FLOP/s from the table below. CPU ranks report no MFU (null).
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainer import events

# Peak dense (no sparsity) fp16/bf16 tensor-core TFLOP/s, from the vendor's datasheets.
PEAK_TFLOPS: list[tuple[str, float, str]] = [
    (r"H200", 989.0, "NVIDIA H200 datasheet: BF16/FP16 tensor 1,979 TFLOPS with sparsity -> 989 dense"),
    (r"H100.*PCIe", 756.0, "NVIDIA H100 datasheet: H100 PCIe BF16/FP16 1,513 with sparsity -> 756 dense"),
    (r"H100", 989.0, "NVIDIA H100 datasheet: H100 SXM BF16/FP16 1,979 with sparsity -> 989 dense"),
    (r"A100", 312.0, "NVIDIA A100 datasheet: BF16/FP16 tensor 312 TFLOPS dense"),
    (
        r"RTX 4090",
        165.2,
        ("NVIDIA Ada Lovelace architecture whitepaper: RTX 4090 FP16/BF16 tensor, FP32 accumulate, 165.2 TFLOPS dense"),
    ),
    (r"A10G", 125.0, "AWS G5 / NVIDIA A10 datasheet: BF16/FP16 tensor 125 TFLOPS dense"),
    (r"\bL4\b", 121.0, "NVIDIA L4 datasheet: BF16/FP16 tensor 242 TFLOPS with sparsity -> 121 dense"),
]


def peak_tflops(device_name: str | None) -> float | None:
    """The peak for a GPU name such as 'NVIDIA GeForce RTX 4090'; None for CPU or unknown GPUs."""
    if not device_name:
        return None
    for pattern, peak, _source in PEAK_TFLOPS:
        if re.search(pattern, device_name):
            return peak
    return None


@dataclass(frozen=True)
class Throughput:
    tokens_per_s: float  # global: all ranks together
    tflops_per_gpu: float  # achieved model TFLOP/s per rank (6 x params per token)
    mfu: float | None  # tflops_per_gpu / peak; None on CPU or an unknown GPU


def throughput(tokens: int, seconds: float, params: int, world_size: int, peak: float | None) -> Throughput:
    tokens_per_s = tokens / seconds if seconds > 0 else 0.0
    tflops = 6.0 * params * tokens_per_s / world_size / 1e12
    return Throughput(tokens_per_s, tflops, tflops / peak if peak else None)


@dataclass
class StepRecord:
    """One line of metrics.jsonl."""

    step: int
    loss: float
    lr: float
    tokens: int  # tokens trained so far in this run's data order (samples_seen x seq_len)
    tokens_per_s: float
    step_time_s: float
    tflops_per_gpu: float
    mfu: float | None
    peak_mem_gb: list[float] | None  # per rank, torch.cuda.max_memory_allocated; None on CPU
    skipped: bool = False  # fp16 overflow: DeepSpeed skipped this optimizer step
    loss_scale: float | None = None  # fp16's dynamic loss scale after this step; None for bf16/fp32
    skipped_steps: int = 0  # fp16 overflow steps skipped so far in the run
    fwd_bwd_s: float | None = None  # rank 0: forward + backward of the step's micro-steps (trainer.loop.StepParts)
    optimizer_s: float | None = None  # rank 0: engine.step() calls (CPU Adam, parameter copy back)
    save_s: float | None = None  # checkpoint saves since the previous record, seconds
    time: float = field(default_factory=time.time)

    def line(self, max_steps: int) -> str:
        text = (
            f"step {self.step}/{max_steps} loss {self.loss:.4f} lr {self.lr:.1e} "
            f"tok/s {self.tokens_per_s:.0f} step_time {self.step_time_s:.2f}s"
        )
        if self.mfu is not None:
            text += f" tflops {self.tflops_per_gpu:.1f} mfu {100 * self.mfu:.1f}%"
        if self.peak_mem_gb:
            text += f" mem {max(self.peak_mem_gb):.1f}GB"
        if self.loss_scale is not None:
            text += f" scale {self.loss_scale:g}" + (f" skipped {self.skipped_steps}" if self.skipped_steps else "")
        return text + (" (overflow: step skipped)" if self.skipped else "")


class MetricsLog:
    """Rank 0's outputs: a line per logged step on stdout (job.log) and in metrics.jsonl."""

    def __init__(self, run_dir: Path, max_steps: int):
        self.path, self.max_steps = run_dir / "metrics.jsonl", max_steps

    def write(self, record: StepRecord) -> None:
        print(record.line(self.max_steps), flush=True)
        with self.path.open("a") as handle:
            handle.write(json.dumps(asdict(record)) + "\n")
        events.first_step_done()  # the first record ends the phases before the first step (as the live view's)


def write_summary(run_dir: Path, summary: dict) -> None:
    """summary.json, written atomically (tmp + rename)."""
    tmp = run_dir / f"summary.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, run_dir / "summary.json")

"""The step-time model behind `gpuctl plan`'s tokens/s, ETA and cost: one optimizer step as the terms it is
made of, each a count (FLOPs, bytes, parameters, micro-steps) over a rate (provision/estimate/rates.py: the
node's, measured by `gpuctl doctor`, else a table). Pure Python: the laptop never imports torch.

DeepSpeed ZeRO-1/2 (per rank r of n, grad_accum a, P params, w bytes per 16-bit or fp32 value):
  compute        a x micro x seq x FLOPs/token / FLOP rate (forward + backward, recompute included)
  grad reduce    a x P x w / reduce rate: ZeRO-2 reduces the gradients every micro-step (stage_1_and_2.py
                 reduce_ipg_grads), to each partition's owner; through host memory on GPUs without P2P
  offload d2h    a x P/n x w / device->host rate: each micro-step's gradient partition goes to the host
  cpu adam       P/n / CPU Adam rate (with offload; else the GPU's optimizer)
  offload h2d    P/n x w / host->device rate: the updated 16-bit partition back to the GPU
  param gather   P x w / all-gather rate: every rank's updated partition to every rank
  framework      a x per-micro-step + per-step fixed cost of DeepSpeed's engine (hooks, bucketing, norms)
  checkpoint     save bytes on the node / disk write rate, amortised over checkpoint_every steps
  upload cpu     the same bytes / the uploader's bytes per CPU-second, amortised alike: with an offloaded
                 optimizer CPU Adam runs on every core, so the upload's CPU time (it overlaps the next
                 steps) comes out of theirs (an upper bound); without offload it uses idle cores: 0
FSDP2 (trainer/fsdp_engine.py): per micro-step the parameters are all-gathered for forward and again for
backward (16-bit, P x 2 each) and the fp32 gradients reduce-scattered (P x 4); with CPU offload the shards
cross the host link both ways (2 x P/n x 4 in, P/n x 4 out) and the optimizer steps on the CPU.

The phases run one after another in an offloaded step (the optimizer waits for every gradient, the next
forward for the updated parameters), so the step is the sum of the terms; the bound term is the largest.
Each term has a low-high range from its rate's range; the prediction is the midpoint of the sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from provision.estimate.rates import Rate, Rates, flops_per_micro

if TYPE_CHECKING:
    from provision.estimate.plan_result import PlanResult


@dataclass(frozen=True)
class Term:
    name: str
    amount: float  # the count divided by the rate (for a fixed cost: how many times it is paid)
    unit: str  # what amount counts: FLOP, B, params, x
    rate: Rate
    fast_s: float
    slow_s: float
    what: str  # one line: the count, spelled out

    @property
    def seconds(self) -> float:
        return math.sqrt(self.fast_s * self.slow_s) if self.fast_s > 0 else 0.0


@dataclass(frozen=True)
class StepModel:
    strategy: str
    terms: list[Term]
    tokens_per_step: int  # global: every rank's micro-batches
    max_steps: int | None = None
    save_every: int = 0  # steps one save's seconds are spread over (checkpoint_every, else max_steps)

    @property
    def fast_s(self) -> float:
        return sum(t.fast_s for t in self.terms)

    @property
    def slow_s(self) -> float:
        return sum(t.slow_s for t in self.terms)

    @property
    def step_s(self) -> float:
        return sum(t.seconds for t in self.terms)

    @property
    def bound(self) -> Term:
        return max(self.terms, key=lambda t: t.seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s > 0 else 0.0

    @property
    def measured(self) -> list[str]:
        return [t.name for t in self.terms if t.rate.measured and t.seconds > 0]

    def eta_s(self, steps: int) -> tuple[float, float, float]:
        return steps * self.fast_s, steps * self.step_s, steps * self.slow_s


def _term(name: str, amount: float, unit: str, rate: Rate, what: str) -> Term:
    if amount <= 0 or math.isinf(rate.low):
        return Term(name, amount, unit, rate, 0.0, 0.0, what)
    if rate.unit == "s":  # a fixed cost paid `amount` times
        return Term(name, amount, unit, rate, amount * rate.high, amount * rate.low, what)
    return Term(name, amount, unit, rate, amount / rate.high, amount / rate.low, what)


def step_model(
    result: PlanResult, rates: Rates, save_bytes: float, checkpoint_every: int, max_steps: int | None = None
) -> StepModel:
    """The terms of one optimizer step for plan's result (its input: strategy, ranks, batch, offload)."""
    inp, p = result.input, float(result.params)
    n, a = inp.total_gpus, inp.grad_accum
    w = 4 if inp.precision == "fp32" else 2
    offload = inp.offload_optimizer == "cpu"
    tokens = inp.micro_batch * inp.seq_len
    flops = a * flops_per_micro(result.model, inp.micro_batch, inp.seq_len, inp.gradient_checkpointing)
    terms = [_term("compute", flops, "FLOP", rates.compute, f"{a} x {tokens:,} tokens x forward+backward")]
    multi = n > 1
    if inp.strategy == "fsdp":
        terms += [
            _term("grad reduce", a * p * 4 if multi else 0, "B", rates.reduce, f"{a} x reduce-scatter of fp32 grads"),
            _term("param gather", 2 * a * p * 2 if multi else 0, "B", rates.gather, f"{a} x 2 all-gathers, 16-bit"),
            _term("offload h2d", 2 * a * p / n * 4 if offload else 0, "B", rates.h2d, "shards to the GPU, fwd + bwd"),
            _term("offload d2h", a * p / n * 4 if offload else 0, "B", rates.d2h, "gradient shards to the host"),
        ]
    else:
        terms += [
            _term("grad reduce", a * p * w if multi else 0, "B", rates.reduce, f"{a} x {w}-byte grads to owners"),
            _term("offload d2h", a * p / n * w if offload else 0, "B", rates.d2h, f"{a} x grad partition to host"),
            _term("offload h2d", p / n * w if offload else 0, "B", rates.h2d, "updated partition to the GPU"),
            _term(
                "param gather", p * w if multi and inp.zero_stage in (1, 2) else 0, "B", rates.gather, "updated params"
            ),
        ]
    adam = rates.cpu_adam if offload else rates.gpu_adam
    terms.append(
        _term("cpu adam" if offload else "gpu adam", p / n, "params", adam, f"{p / n / 1e6:,.1f}M params per rank")
    )
    if inp.strategy != "fsdp":
        terms += [
            _term("framework/micro", a, "x", rates.engine_micro, f"{a} micro-steps of DeepSpeed's hooks"),
            _term("framework/step", 1, "x", rates.engine_step, "DeepSpeed's step bookkeeping"),
        ]
    every = checkpoint_every or max_steps or 0
    terms.append(
        _term(
            "checkpoint",
            save_bytes / every if every else 0,
            "B",
            rates.disk,
            f"{save_bytes / 1e9:,.2f} GB per save / {every or '-'} steps",
        )
    )
    terms.append(
        _term(
            "upload cpu",
            save_bytes / every if every and offload else 0,
            "B",
            rates.upload_cpu,
            "the save's upload, competing with CPU Adam for the cores" if offload else "no offload: idle cores",
        )
    )
    global_tokens = tokens * a * n
    return StepModel(inp.strategy, terms, global_tokens, max_steps, every)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None  # JSON has no infinity (CPU ranks' device copy)


def model_to_json(model: StepModel) -> dict[str, Any]:
    return {
        "strategy": model.strategy,
        "step_s": round(model.step_s, 6),
        "step_s_range": [round(model.fast_s, 6), round(model.slow_s, 6)],
        "tokens_per_step": model.tokens_per_step,
        "tokens_per_s": round(model.tokens_per_s, 2),
        "bound": model.bound.name,
        "save_every": model.save_every,
        "measured_terms": model.measured,
        "terms": [
            {
                "name": t.name,
                "seconds": round(t.seconds, 6),
                "range_s": [round(t.fast_s, 6), round(t.slow_s, 6)],
                "amount": t.amount,
                "unit": t.unit,
                "rate": {"low": _finite(t.rate.low), "high": _finite(t.rate.high), "unit": t.rate.unit},
                "source": t.rate.source,
                "what": t.what,
            }
            for t in model.terms
        ],
    }


def rates_for(result: PlanResult, accelerator: str = "cuda", doctor: dict[str, Any] | None = None) -> Rates:
    """The tables' rates for plan's GPU (CPU ranks: accelerator "cpu"), with each rate a node measured in its
    place: the slowest node's, as the slowest node bounds a synchronous step."""
    from provision.estimate.rates import merge, node_rates, table_rates

    inp = result.input
    peak = (result.gpu.peak_tflops_fp32 if inp.precision == "fp32" else result.gpu.peak_tflops_16bit) * 1e12
    pinned = inp.pinning != "off"
    table = table_rates(
        result.gpu if accelerator == "cuda" else None,
        peak,
        (inp.mfu_low, inp.mfu_high),
        inp.micro_batch * inp.seq_len,
        inp.total_gpus,
        pinned,
    )
    slowest: dict[str, Rate] = {}
    for host, raw in (doctor or {}).items():
        if not isinstance(raw, dict):
            continue
        for key, rate in node_rates(raw, result.model, host, inp.total_gpus).items():
            old = slowest.get(key)
            slower = old is None or (rate.mid > old.mid if rate.unit == "s" else rate.mid < old.mid)
            slowest[key] = rate if slower else old  # type: ignore[assignment]
    return merge(table, slowest, pinned)


def predict(
    result: PlanResult,
    *,
    accelerator: str = "cuda",
    doctor: dict[str, Any] | None = None,
    checkpoint_every: int = 0,
    max_steps: int | None = None,
) -> StepModel:
    """plan's result as a step-time model: the node figures where the doctor measured them, else tables."""
    from provision.estimate.checkpoint_cost import save_bytes

    node_bytes = save_bytes(result, result.input.strategy)[0]
    return step_model(result, rates_for(result, accelerator, doctor), node_bytes, checkpoint_every, max_steps)

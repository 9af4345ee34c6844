"""The rates `gpuctl plan`'s step-time model needs, measured on the node by `gpuctl doctor`.

One process per rank, as a run has them (the same thread share, trainer.hostenv.bind_threads, and
all ranks busy at once: on a node whose ranks share cores or memory bandwidth, that is what a step
sees). Each phase starts behind a barrier and the slowest rank's time is kept, as the slowest rank
bounds a synchronous step:

- compute: forward + backward of the run's model shape (a Llama of the configured dims, random
  weights, the run's precision, micro_batch x seq_len, activation checkpointing as configured).
  A model of more than 4 layers is timed with 1 and 2 layers and the rest extrapolated
  (t(L) = t1 + (L-1)(t2 - t1)), so a 7B shape fits one GPU in seconds;
- cpu_adam: DeepSpeed's CPU Adam (the op a ZeRO-Offload run steps with) on a rank's share of the
  parameters, capped at ADAM_CAP elements (the op streams its 16 bytes per parameter through memory:
  past the caches its rate no longer depends on the size);
- copy (GPU ranks): host->device and device->host of COPY_MB, from pinned and from pageable memory.

Disk write rate (`disk_write`) is one process: bytes written and fsync'd in the workdir.
Every figure is a plain number in JSON; the laptop (provision/estimate/rates.py) reads and judges them.
"""

from __future__ import annotations

import os
import secrets
import statistics
import time
from pathlib import Path
from typing import Any

WARMUP = 1
ITERS = 5
PAIRS = 8  # forward+backward alone / followed by the reduction, alternated; medians (a loaded node's outliers)
ADAM_CAP = 32_000_000  # elements: 512 MB of param + grad + m + v per rank
COPY_MB = 256
LAYERS_TIMED = 4  # a model with more layers is timed at 1 and 2 and extrapolated


def disk_write(path: str, size_mb: int) -> dict[str, Any]:
    """Write size_mb MB to a new file under path, fsync it, delete it: bytes/s as a checkpoint save sees it."""
    folder = Path(path).expanduser()
    while not folder.exists() and folder != folder.parent:  # a workdir `up` has not made yet
        folder = folder.parent
    target = folder / f".gpuctl-doctor-disk-{secrets.token_hex(4)}"
    block = os.urandom(4 << 20)  # random bytes: a compressing file system cannot shortcut them
    try:
        start = time.perf_counter()
        with target.open("wb") as handle:
            for _ in range(max(1, size_mb // 4)):
                handle.write(block)
            handle.flush()
            os.fsync(handle.fileno())
        seconds = time.perf_counter() - start
    except OSError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300], "path": str(folder)}
    finally:
        target.unlink(missing_ok=True)
    written = max(1, size_mb // 4) * (4 << 20)
    return {"path": str(folder), "bytes": written, "seconds": seconds, "bytes_per_s": written / seconds}


def _timed(fn, barrier, warmup: int = WARMUP, iters: int = ITERS) -> list[float]:
    """Seconds of each of `iters` calls of fn, each started behind a barrier (all ranks at once)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        barrier()
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def _model(dims: dict[str, Any], layers: int, precision: str, device: str, ckpt: bool):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=dims["vocab"],
        hidden_size=dims["hidden"],
        intermediate_size=dims["intermediate"],
        num_hidden_layers=layers,
        num_attention_heads=dims["heads"],
        num_key_value_heads=dims.get("kv_heads") or dims["heads"],
        tie_word_embeddings=bool(dims.get("tied_embeddings")),
        use_cache=False,
    )
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", torch_dtype=dtype).to(device)
    if ckpt:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    return model.train()


def _reducer(model, device: str):
    """ZeRO-2's gradient reduction (stage_1_and_2.py average_tensor with reduce_scatter): the gradients
    flattened into one bucket, each rank's partition reduced to its owner, then the owner's share
    added into a host fp32 buffer (the offloaded accumulation). Returns (run, bytes reduced)."""
    import torch
    import torch.distributed as dist

    params = list(model.parameters())
    n, rank = dist.get_world_size(), dist.get_rank()
    numel = sum(p.numel() for p in params)
    part = -(-numel // n)
    bucket = torch.zeros(part * n, dtype=params[0].dtype, device=device)
    host = torch.zeros(part, dtype=torch.float32)

    def run() -> None:
        torch.cat([p.grad.reshape(-1) for p in params], out=bucket[:numel])
        for owner in range(n):
            dist.reduce(bucket[owner * part : (owner + 1) * part], dst=owner)
        host.add_(bucket[rank * part : (rank + 1) * part].float().cpu())
        model.zero_grad(set_to_none=False)

    def gather() -> None:  # after the update: every rank's new parameters to every rank
        dist.all_gather_into_tensor(bucket, bucket[rank * part : (rank + 1) * part].clone())

    return run, gather, numel * bucket.element_size()


def _time_shape(req: dict[str, Any], layers: int, device: str, barrier) -> tuple[float, dict[str, float]]:
    """(mean forward + backward seconds, the reduction's figures) of the run's shape with `layers` layers."""
    import torch
    import torch.nn.functional as F

    dims, micro, seq = req["model"], int(req["micro_batch"]), int(req["seq_len"])
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    model = _model(dims, layers, req.get("precision", "fp32"), device, bool(req.get("checkpointing")))
    tokens = torch.randint(0, dims["vocab"], (micro, seq + 1), device=device)
    reduce_grads, gather, nbytes = _reducer(model, device)

    def step(reduced: bool = False) -> None:
        logits = model(input_ids=tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        loss.backward()
        if reduced:
            reduce_grads()
        sync()

    step(True)  # warm-up, both kinds
    plain, with_reduce = [], []
    for _ in range(PAIRS):  # alternate: drifting load hits both kinds alike
        plain += _timed(step, barrier, warmup=0, iters=1)
        with_reduce += _timed(lambda: step(True), barrier, warmup=0, iters=1)
    gathered = _timed(lambda: (gather(), sync()), barrier)
    middle = statistics.median(plain)
    return middle, {
        "bytes": nbytes,
        "seconds": max(statistics.median(with_reduce) - middle, 1e-6),
        "gather_s": statistics.median(gathered),
    }


def _compute(req: dict[str, Any], device: str, barrier) -> dict[str, Any]:
    """forward + backward alone, and followed by the gradient reduction: the reduction's seconds are the
    difference, so a rank's wait for the slowest rank's backward (cores shared, a straggler) counts in it."""
    total = int(req["model"]["layers"])
    timed = [total] if total <= LAYERS_TIMED else [1, 2]
    means: dict[int, float] = {}
    reduce: dict[str, float] = {}
    for layers in timed:
        means[layers], reduce = _time_shape(req, layers, device, barrier)
    if len(timed) == 1:
        seconds = means[total]
    else:  # a layer's cost from the difference; never below a tenth of the one-layer model's (noise)
        per_layer = max(means[2] - means[1], means[1] / 10)
        seconds = means[1] + (total - 1) * per_layer
    return {
        "seconds": seconds,
        "layers_timed": timed,
        "micro_batch": int(req["micro_batch"]),
        "seq_len": int(req["seq_len"]),
        "layers": total,
        "checkpointing": bool(req.get("checkpointing")),
        "reduce": reduce,
    }


SKELETON = {"hidden": 16, "heads": 2, "kv_heads": 2, "intermediate": 32, "vocab": 64}


def _engine_overhead(req: dict[str, Any], device: str, barrier) -> dict[str, Any]:
    """What DeepSpeed's engine adds per micro-step (hooks, bucketing, loss scaling) and per optimizer step
    (norm, clipping, partition bookkeeping), in seconds: its engine on a skeleton of the model (the same
    layers and parameter tensors, width 16, 16 tokens), minus the skeleton's own forward + backward."""
    import deepspeed
    import torch
    import torch.nn.functional as F

    precision = req.get("precision", "fp32")
    dims = {**req["model"], **SKELETON}
    model = _model(dims, int(dims["layers"]), precision, device, False)
    tokens = torch.randint(0, dims["vocab"], (1, 17), device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def loss_of(module) -> Any:
        logits = module(input_ids=tokens[:, :-1]).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))

    plain = _timed(lambda: (loss_of(model).backward(), sync()), barrier, iters=2 * ITERS)
    model.zero_grad(set_to_none=True)
    zero: dict[str, Any] = {"stage": int(req.get("zero_stage") or 2), "overlap_comm": False}
    if req.get("adam_params"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "fp16": {"enabled": precision == "fp16"},
        "bf16": {"enabled": precision == "bf16"},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    fwd_bwd: list[float] = []
    steps: list[float] = []
    for i in range(WARMUP + 2 * ITERS):
        barrier()
        start = time.perf_counter()
        engine.backward(loss_of(engine))
        sync()
        middle = time.perf_counter()
        engine.step()
        sync()
        if i >= WARMUP:
            fwd_bwd.append(middle - start)
            steps.append(time.perf_counter() - middle)
    median = statistics.median
    return {
        "micro_s": max(median(fwd_bwd) - median(plain), 0.0),
        "step_s": median(steps),
        "tensors": len(list(model.parameters())),
    }


def _cpu_adam(numel: int, barrier) -> dict[str, Any]:
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    param = torch.nn.Parameter(torch.randn(numel, dtype=torch.float32))
    param.grad = torch.randn(numel, dtype=torch.float32)
    opt = DeepSpeedCPUAdam([param], lr=1e-4, adamw_mode=True)
    times = _timed(opt.step, barrier)
    return {"params": numel, "seconds": statistics.median(times), "threads": torch.get_num_threads()}


def _copy(local: int, barrier) -> dict[str, Any]:
    import torch

    n = COPY_MB << 20
    dev = torch.empty(n, dtype=torch.uint8, device=f"cuda:{local}")
    out: dict[str, Any] = {"bytes": n}
    for kind in ("pinned", "pageable"):
        host = torch.empty(n, dtype=torch.uint8, pin_memory=kind == "pinned")
        for way, fn in (("h2d", lambda h=host: dev.copy_(h)), ("d2h", lambda h=host: h.copy_(dev))):
            times = _timed(lambda f=fn: (f(), torch.cuda.synchronize()), barrier)
            out[f"{way}_{kind}_s"] = statistics.median(times)
    return out


def _rank(local: int, req: dict[str, Any], port: int, out: Any) -> None:
    import datetime

    os.environ.update(LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(req["ranks"]))
    from trainer.hostenv import bind_threads

    bind_threads()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    cuda = req.get("accelerator") == "cuda"
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=local,
        world_size=int(req["ranks"]),
        timeout=datetime.timedelta(seconds=300),
    )
    facts: dict[str, Any] = {"threads": torch.get_num_threads()}
    try:
        for name, run in (
            (
                "compute",
                lambda: _compute(req, f"cuda:{local}" if cuda else "cpu", dist.barrier) if req.get("model") else None,
            ),
            (
                "engine",
                lambda: (
                    _engine_overhead(req, f"cuda:{local}" if cuda else "cpu", dist.barrier)
                    if req.get("model") and req.get("strategy", "deepspeed") == "deepspeed"
                    else None
                ),
            ),
            ("cpu_adam", lambda: _cpu_adam(int(req["adam_params"]), dist.barrier) if req.get("adam_params") else None),
            ("copy", lambda: _copy(local, dist.barrier) if cuda else None),
        ):
            try:
                result = run()
            except Exception as exc:  # noqa: BLE001 - out of memory, a missing op: the figure says so
                result = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            dist.barrier()
            if result is not None:
                facts[name] = result
        out.put((local, facts))
    finally:
        dist.destroy_process_group()


def _slowest(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase, the figures of the rank whose time was longest (it bounds the step); errors win."""
    merged: dict[str, Any] = {"threads": [f.get("threads") for f in per_rank]}
    for name in ("compute", "engine", "cpu_adam", "copy"):
        found = [f[name] for f in per_rank if name in f]
        if not found:
            continue
        errors = [f for f in found if "error" in f]
        if errors:
            merged[name] = errors[0]
            continue
        key = {"copy": "h2d_pinned_s", "engine": "micro_s"}.get(name, "seconds")
        merged[name] = max(found, key=lambda f: float(f.get(key) or 0.0))
    return merged


def measure(req: dict[str, Any]) -> dict[str, Any]:
    """req: ranks, accelerator, model (dims, or None), micro_batch, seq_len, precision, checkpointing,
    adam_params (a rank's share, None without offload). Returns the slowest rank's figures."""
    import torch.multiprocessing as mp

    from trainer.doctor_allreduce import _free_port

    req = {**req, "adam_params": min(int(req["adam_params"]), ADAM_CAP) if req.get("adam_params") else None}
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    ranks = int(req.get("ranks") or 1)
    try:
        mp.start_processes(_rank, args=(req, _free_port(), queue), nprocs=ranks, join=True, start_method="spawn")
    except Exception as exc:  # noqa: BLE001 - ProcessRaisedException carries the rank's traceback
        return {"error": (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:300]}
    per_rank = [queue.get()[1] for _ in range(ranks)]
    return _slowest(per_rank)

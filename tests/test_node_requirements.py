"""provision.estimate.node: host RAM per node (load, steady, resume), disk, collective timeout; offers use them.

DeepSpeed's own buffers are checked against these figures by test_trainer_end_of_run.py (gpu_check's CPU
smoke, 1 and 3 ranks); here: the seed numbers, the arithmetic, and that `plan`, `offers` and `up` use them.
"""

from __future__ import annotations

import json
import math

import pytest

from provision.core.config import GpuctlConfig
from provision.core.provider_config import VastProvider
from provision.estimate.hardware import GB, KNOWN_MODELS, ModelDims
from provision.estimate.node import (
    TIMEOUT_FLOOR_S,
    collective_timeout_s,
    node_requirements,
    partitions,
    pow2,
    rank_buffers,
)
from provision.estimate.plan import plan, plan_to_json
from provision.estimate.plan_input import PlanInput
from provision.estimate.sizing import sized_provider

SEED = dict(model="deepseek-7b", precision="fp16", gpu_mem_gb=24)  # 3 x RTX 4090, ZeRO-2 offload, ga 4
P = 6_910_365_696


def terms(phase) -> dict[str, float]:
    return {t.name: t.gb for t in phase}


def test_seed_partition_and_buffers_per_rank():
    size, ranks = rank_buffers(PlanInput(**SEED))
    assert size == P // 3 == 2_303_455_232  # P is a multiple of 2 x world: no padding
    r = ranks[0]
    assert (r.master, r.staging, r.grads, r.adam) == (4 * size, 2 * size, 4 * size, 8 * size)
    assert r.grad_staging == 2 * 102_400 * 4096  # the embedding / lm_head
    # round-robin ownership: each rank's accumulation buffers hold whole tensors, ~2 B x its partition
    for rank in ranks:
        assert 2 * size <= sum(rank.accum) < 2 * size + 2 * 2 * 102_400 * 4096
    raw = sum(r.master + r.staging + r.grads + r.grad_staging + sum(r.accum) + r.adam for r in ranks) / 3
    assert raw / GB == pytest.approx(46.9, abs=0.2)  # issue 21's "about 46.9 GB per rank"


def test_seed_node_figures_and_named_terms():
    req = node_requirements(PlanInput(**SEED))
    steady = terms(req.steady)
    assert steady["fp32 master (pinned)"] == pytest.approx(3 * 4 * P / 3 / GB)
    assert steady["fp32 gradients (pinned)"] == pytest.approx(27.64, abs=0.01)
    assert steady["16-bit param staging (pinned)"] == pytest.approx(13.82, abs=0.01)
    assert steady["Adam m + v"] == pytest.approx(55.29, abs=0.01)
    assert steady["grad accumulation (pinned)"] == pytest.approx(13.9, abs=0.1)
    assert steady["processes"] == 9.0
    assert req.steady_gb == pytest.approx(149.8, abs=0.1)
    assert req.load_gb == pytest.approx(122.1, abs=0.1)  # optimizer init: pinned copies of pageable buffers
    assert req.resume_gb == pytest.approx(135.9, abs=0.1)  # mmap: Adam m/v copied off the mapped shard
    assert req.save_gb == pytest.approx(163.7, abs=0.1)  # steady + rank 0's 13.8 GB module-states copy
    assert math.ceil(req.ram_gb) == 168
    assert req.checkpoint_gb == pytest.approx(96.75, abs=0.01)  # 2P module + 12 B x P of shards
    assert terms(req.disk) == {
        "model download (HF cache)": pytest.approx(13.82, abs=0.01),
        "checkpoints (2 kept + 1 being written)": pytest.approx(290.2, abs=0.1),
        "trainer image": 20.0,
    }
    assert math.ceil(req.disk_gb) == 325


def test_pinning_exact_and_off_cost_the_same_steady_bytes_pow2_does_not():
    exact, off, rounded = (node_requirements(PlanInput(**SEED, pinning=p)) for p in ("exact", "off", "pow2"))
    assert exact.steady_gb == pytest.approx(off.steady_gb)
    assert off.load_gb < exact.load_gb  # no pageable copy of each pinned buffer
    assert off.pinned_gb == 0 and exact.pinned_gb == pytest.approx(85.6, abs=0.1)
    assert rounded.pinned_alloc_gb == pytest.approx(150.5, abs=0.1)  # 9.2 GB partitions pin 17.2 GB
    assert rounded.ram_gb - exact.ram_gb == pytest.approx(rounded.pinned_alloc_gb - exact.pinned_gb, abs=0.01)
    assert pow2(9.21e9) == 2**34 and pow2(2**25) == 2**25


def test_grad_accum_one_has_no_accumulation_buffers():
    steady = terms(node_requirements(PlanInput(**SEED, grad_accum=1)).steady)
    assert steady["grad accumulation (pinned)"] == 0


def test_resume_without_mmap_reads_every_shard_into_ram():
    mapped, read = (node_requirements(PlanInput(**SEED, resume_mmap=m)) for m in (True, False))
    assert terms(read.resume)["optimizer shard read into RAM"] == pytest.approx(82.9, abs=0.1)
    assert read.resume_gb == pytest.approx(163.5, abs=0.1)
    assert read.resume_gb > read.steady_gb
    assert mapped.resume_gb < mapped.steady_gb


def test_big_gpu_flattens_on_the_gpu_small_one_on_the_cpu():
    small = node_requirements(PlanInput(**SEED, offload_optimizer="none", grad_accum=1))
    big = node_requirements(PlanInput(model="deepseek-7b", gpu="H200", offload_optimizer="none"))
    assert "ZeRO flatten on the CPU" in terms(small.load)  # 24 GB cannot hold two 13.8 GB copies
    assert "ZeRO flatten on the CPU" not in terms(big.load)
    assert terms(small.load)["ZeRO flatten on the CPU"] == pytest.approx(3 * 2 * 2 * P / GB)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("round_robin", [False, True])
def test_partitions_cover_every_element_once(world, round_robin):
    numels = KNOWN_MODELS["tiny"].param_numels()
    size, overlap = partitions(numels, world, round_robin)
    assert size * world >= sum(numels) and size * world % (2 * world) == 0
    assert sum(len(o) for o in overlap) >= len(numels)  # boundary tensors count on both sides
    if not round_robin:
        assert overlap[0][0] == numels[0] and overlap[-1][-1] == numels[-1]


def test_partitions_by_hand():
    assert partitions([4, 4, 4], 2, False) == (6, [[4, 4], [4, 4]])  # the middle tensor straddles
    assert partitions([4, 2, 6], 2, True) == (6, [[4, 6], [6, 2]])  # order: 4, 6 (even idx), then 2


def test_collective_timeout_floor_and_derived():
    tiny = PlanInput(model="tiny")
    assert collective_timeout_s(tiny)[0] == TIMEOUT_FLOOR_S
    seconds, waits = collective_timeout_s(PlanInput(**SEED))
    named = {t.name: t.gb for t in waits}
    assert named["resume download"] == pytest.approx(96.75e9 / 50e6, rel=1e-3)
    assert seconds == math.ceil(3 * 96.75e9 / 50e6 / 60) * 60 == 5820
    big_data = collective_timeout_s(PlanInput(**SEED, data_bytes=5 * 10**9))
    assert big_data[0] == 3 * 5000 and "tokenize" in {t.name for t in big_data[1]}


def test_plan_json_and_why_carry_the_node_figures():
    r = plan(PlanInput(**SEED))
    d = plan_to_json(r)
    assert d["host_ram_gb"] == pytest.approx(r.node.ram_gb, abs=1e-3)
    assert d["node"]["steady"]["Adam m + v"] == pytest.approx(55.29, abs=0.01)
    assert d["node"]["disk_gb"] == pytest.approx(324.06, abs=0.01) and d["collective_timeout_s"] == 5820
    assert d["ds_host_ram_gb"] == pytest.approx(165.8, abs=0.1)
    assert json.loads(json.dumps(d)) == d
    closing = next(line for line in r.why if line.startswith("Before:"))
    assert "165.8 GB" in closing and "128 GB RAM and 200 GB disk" in closing and "168 GB RAM and 325 GB" in closing
    assert any("consider precision bf16" in line for line in r.why)
    assert not any("bf16" in line for line in plan(PlanInput(**(SEED | {"precision": "bf16"}))).why[-1:])


def test_plan_command_prints_load_steady_resume_and_disk(project, gpuctl):
    result = gpuctl("plan", env={"COLUMNS": "160"})
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for text in ("load GB", "steady GB", "resume GB", "Adam m + v", "grad accumulation (pinned)", "disk total"):
        assert text in out, text
    assert "168" in out and "325" in out and "save GB" in out


def seed_cloud(**prov) -> GpuctlConfig:
    return GpuctlConfig.model_validate(
        {
            "provider": {"kind": "vast", **prov},
            "train": {"model": "deepseek-7b", "precision": "fp16", "seq_len": 2048, "gradient_checkpointing": True},
        }
    )


def test_sized_provider_takes_plans_figures_unless_set():
    sized = sized_provider(seed_cloud())
    assert (sized.min_ram_gb, sized.disk_gb) == (168, 325)
    mine = sized_provider(seed_cloud(min_ram_gb=512, disk_gb=1000))
    assert (mine.min_ram_gb, mine.disk_gb) == (512, 1000)  # the user's word wins
    tiny = sized_provider(GpuctlConfig.model_validate({"provider": {"kind": "vast"}}))
    assert (tiny.min_ram_gb, tiny.disk_gb) == (128, 200)  # never below the defaults
    unknown = GpuctlConfig.model_validate({"provider": {"kind": "vast"}, "train": {"model": "org/other-7b"}})
    assert sized_provider(unknown) is unknown.provider


def test_up_and_offers_filter_on_plans_figures(project, gpuctl, sshd, monkeypatch):
    from tests.fakes.harness import ssh_target
    from tests.fakes.vast_api import FakeVast

    with FakeVast(ssh=ssh_target(sshd)) as fake:
        monkeypatch.setenv("VAST_API_KEY", fake.key)
        cfg = {
            "provider": {"kind": "vast", "api_url": fake.url, "max_price": 0.01},
            "train": {"model": "deepseek-7b", "precision": "fp16", "seq_len": 2048, "gradient_checkpointing": True},
            "storage": {"url": "s3://bucket/gpuctl"},  # `up` gets as far as the offers
        }
        (project / "gpuctl.yaml").write_text(json.dumps(cfg))
        up = gpuctl("up", "--yes")
        offers = gpuctl("offers")
    assert up.returncode != 0 and "cpu_ram>=168 GB" in up.stderr and "disk_space>=325 GB" in up.stderr, up.stderr
    assert "cpu_ram>=168 GB" in offers.stdout + offers.stderr


def test_vast_query_carries_the_sized_minimums():
    from provision.providers import vast

    query = vast.search_query(sized_provider(seed_cloud()))
    assert query["cpu_ram"] == {"gte": 168_000} and query["disk_space"] == {"gte": 325}
    assert isinstance(seed_cloud().provider, VastProvider)


def test_custom_dims_param_order_matches_parameters():
    dims = ModelDims("x", layers=2, hidden=64, heads=4, intermediate=172, vocab=100)
    numels = dims.param_numels()
    assert numels[0] == numels[-1] == 6400 and sum(numels) == dims.params

"""The trainer's host side without DeepSpeed: thread share per rank, pinning policy, disk room, the
collective timeout knob, the tokenizer round-trip, and what render gives a GPU node (DeepSpeed parses it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from provision.core.config import GpuctlConfig
from provision.estimate.node import node_requirements
from provision.estimate.plan_input import PlanInput
from provision.flows.render import BundleNode, BundleSpec, render_bundle
from tests.helpers import REPO, free_port
from trainer import diskroom, hostenv, pinning
from trainer.config import DEFAULT_COLLECTIVE_TIMEOUT_S, TrainerError, parse_run_config
from trainer.diskroom import LocalTag, Room, plan_room

GB = 10**9


# -- CPU threads ------------------------------------------------------------------------------------
def fake_sys(tmp_path: Path, topology: dict[int, tuple[int, int]]) -> Path:
    """A /sys/devices/system/cpu tree: cpu -> (package, core)."""
    for cpu, (package, core) in topology.items():
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{package}\n")
        (topo / "core_id").write_text(f"{core}\n")
    return tmp_path


def test_physical_cores_keep_hyperthread_siblings_together(tmp_path):
    # 8 logical CPUs, 4 cores: Linux numbers the second threads 4-7
    sys_cpu = fake_sys(tmp_path, {c: (0, c % 4) for c in range(8)})
    assert hostenv.physical_cores(set(range(8)), sys_cpu) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert hostenv.physical_cores({1, 2, 5}, sys_cpu) == [[1, 5], [2]]  # a container's cpuset
    assert hostenv.physical_cores({0, 1}, tmp_path / "nothing") == [[0], [1]]


def test_core_share_splits_like_deepspeed_and_shares_when_short():
    cores = [[c] for c in range(16)]
    shares = [hostenv.core_share(cores, r, 3) for r in range(3)]
    assert [len(s) for s in shares] == [5, 5, 5]  # 16 // 3, one core left over (DeepSpeed's rule)
    assert sorted(c for s in shares for core in s for c in core) == list(range(15))
    assert [hostenv.core_share(cores[:2], r, 3) for r in range(3)] == [[], [], []]  # fewer cores than ranks


BIND = "import os; from trainer import hostenv; print(hostenv.bind_threads()); " + (
    "print(os.environ.get('OMP_NUM_THREADS'), sorted(os.sched_getaffinity(0)))"
)


@pytest.mark.parametrize("local_rank", [0, 1])
def test_bind_threads_sets_omp_and_affinity_per_rank(local_rank):
    cpus = sorted(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(LOCAL_RANK=str(local_rank), LOCAL_SIZE="2", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", BIND], env=env, capture_output=True, text=True, timeout=60)
    said, numbers = out.stdout.strip().splitlines()
    cores = hostenv.physical_cores(set(cpus))
    share = hostenv.core_share(cores, local_rank, 2)
    if not share:  # a 1-core machine: one thread, the OS places it
        assert numbers == f"1 {cpus}" and said.startswith("1 thread, not bound")
        return
    assert numbers == f"{len(share)} {sorted(c for core in share for c in core)}"
    assert said.startswith(f"{len(share)} thread") and " on CPUs " in said


def test_bind_threads_can_leave_placement_to_the_os():
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(LOCAL_RANK="0", LOCAL_SIZE="1", GPUCTL_BIND_CORES="0", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", BIND], env=env, capture_output=True, text=True, timeout=60)
    said, numbers = out.stdout.strip().splitlines()
    cores = len(hostenv.physical_cores(os.sched_getaffinity(0)))
    assert "not bound (GPUCTL_BIND_CORES=0" in said and numbers == f"{cores} {sorted(os.sched_getaffinity(0))}"


def test_bind_threads_leaves_a_set_omp_alone():
    env = dict(os.environ, OMP_NUM_THREADS="7", LOCAL_RANK="0", LOCAL_SIZE="2", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", BIND], env=env, capture_output=True, text=True, timeout=60)
    said, numbers = out.stdout.strip().splitlines()
    assert said == "None" and numbers == f"7 {sorted(os.sched_getaffinity(0))}"


@pytest.mark.parametrize(
    ("files", "cpus"),
    [
        ({"cpu.max": "250000 100000\n"}, 2.5),  # cgroup v2: docker --cpus 2.5
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "150000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1.5),  # v1
        ({"cpu,cpuacct/cpu.cfs_quota_us": "400000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, 4.0),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),
    ],
)
def test_cgroup_cpu_limit_reads_v1_and_v2_quotas(tmp_path, files, cpus):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert hostenv.cgroup_cpu_limit(tmp_path) == cpus


BIND_QUOTA = "import os, sys; from pathlib import Path; from trainer import hostenv; " + (
    "print(hostenv.bind_threads(cgroup_root=Path(sys.argv[1]))); "
    "print(os.environ.get('OMP_NUM_THREADS'), sorted(os.sched_getaffinity(0)))"
)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_bind_threads_counts_no_more_cores_than_the_cgroup_quota(tmp_path, version):
    cores = hostenv.physical_cores(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 physical cores to see a 1-CPU quota cap them")
    if version == "v2":
        (tmp_path / "cpu.max").write_text("100000 100000\n")
    else:
        (tmp_path / "cpu").mkdir()
        (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("120000\n")  # 1.2 CPUs: one whole thread
        (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(LOCAL_RANK="0", LOCAL_SIZE="1", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", BIND_QUOTA, str(tmp_path)], env=env, capture_output=True, text=True)
    said, numbers = out.stdout.strip().splitlines()
    assert numbers == f"1 {cores[0]}" and "CPU quota" in said, out.stdout + out.stderr


def test_bind_threads_replaces_torchruns_default_but_not_the_users():
    cores = hostenv.physical_cores(os.sched_getaffinity(0))
    base = dict(os.environ, OMP_NUM_THREADS="1", LOCAL_RANK="0", LOCAL_SIZE="1", PYTHONPATH=str(REPO))
    marked = dict(base, GPUCTL_OMP_FROM_TORCHRUN="1")  # torchrun.sh: torchrun found none and set 1
    out = subprocess.run([sys.executable, "-c", BIND], env=marked, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().splitlines()[1].startswith(f"{len(cores)} "), out.stdout + out.stderr
    out = subprocess.run([sys.executable, "-c", BIND], env=base, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().splitlines() == ["None", f"1 {sorted(os.sched_getaffinity(0))}"]


def test_ranks_load_no_compiler_unless_the_environment_asks():
    env: dict[str, str] = {}
    hostenv.no_compiler(env)  # DeepSpeed's Muon decorates with torch.compile at import: a no-op now
    assert env == {"TORCHDYNAMO_DISABLE": "1"}
    mine = {"TORCHDYNAMO_DISABLE": "0"}  # gpuctl.yaml env: the user compiles in their own code
    hostenv.no_compiler(mine)
    assert mine == {"TORCHDYNAMO_DISABLE": "0"}


def test_a_rank_takes_the_cpu_census_once(monkeypatch):
    import cpuinfo

    monkeypatch.setattr(cpuinfo, "get_cpu_info", cpuinfo.get_cpu_info)  # put back after the test
    hostenv.cpu_info_once()
    hostenv.cpu_info_once()  # a second call wraps nothing again
    first = cpuinfo.get_cpu_info()  # what DeepSpeed's op builders read, from a Python subprocess
    assert first["arch"] and cpuinfo.get_cpu_info() is first  # the second op load asks no new process
    assert cpuinfo.get_cpu_info.cache_info().misses == 1


# -- pinned memory ----------------------------------------------------------------------------------
def test_pin_env_only_for_gpu_ranks_on_torch_213():
    env: dict[str, str] = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert pinning.pin_env(env, version=(2, 10)) is None and "PYTORCH_ALLOC_CONF" not in env
    merged = pinning.pin_env(env, version=(2, 13))
    assert merged == "expandable_segments:True," + pinning.PIN_CONF
    assert env["PYTORCH_ALLOC_CONF"] == env["PYTORCH_CUDA_ALLOC_CONF"] == merged  # both aliases agree
    assert pinning.pin_env(env, version=(2, 13)) is None  # already there: left alone
    assert pinning.exact_pinning(env, version=(2, 13)) and not pinning.exact_pinning(env, version=(2, 12))
    assert pinning.pin_env({"DS_ACCELERATOR": "cpu"}, version=(2, 13)) is None


def test_torch_213_accepts_the_pinned_settings():
    """This venv's torch (2.13) parses the keys; 2.10-2.12 have none (checked in their wheels' libc10.so)."""
    env = dict(os.environ, PYTORCH_ALLOC_CONF=pinning.PIN_CONF)
    code = "import torch; print(torch._C._accelerator_getAllocatorSettings())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if pinning.torch_version() < pinning.EXACT_PIN_TORCH:
        pytest.skip("torch < 2.13 here")
    assert out.returncode == 0 and pinning.PIN_CONF in out.stdout


def test_settle_pin_memory_turns_rounding_pinning_off():
    cfg = {"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    assert pinning.settle_pin_memory(cfg, exact=True) is False
    assert cfg["zero_optimization"]["offload_optimizer"]["pin_memory"] is True
    assert pinning.settle_pin_memory(cfg, exact=False) is True
    assert cfg["zero_optimization"]["offload_optimizer"]["pin_memory"] is False
    default_on = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    assert pinning.settle_pin_memory(default_on, exact=False) is True  # DeepSpeed's default is on
    assert pinning.settle_pin_memory({"zero_optimization": {}}, exact=False) is False


# -- disk room --------------------------------------------------------------------------------------
def tags(*steps: int, size: int = 100) -> list[LocalTag]:
    return [LocalTag(s, f"step{s}", size) for s in steps]


def test_room_when_free_space_suffices_prunes_beyond_keep_local():
    verdict, delete = plan_room(tags(1, 2, 3), {"step1", "step2"}, set(), ["step3"], 10_000, 100, keep_local=2)
    assert verdict == Room.ROOM and [t.name for t in delete] == ["step1"]


def test_short_disk_deletes_uploaded_tags_within_keep_local_first():
    verdict, delete = plan_room(tags(1, 2, 3), {"step1", "step2"}, set(), ["step3"], 50, 100, keep_local=3)
    assert verdict == Room.ROOM and [t.name for t in delete] == ["step1"]


def test_short_disk_with_uploads_pending_waits_and_never_deletes_them():
    verdict, delete = plan_room(tags(4, 5), {"step3"}, set(), ["step4", "step5"], 50, 100, keep_local=1)
    assert verdict == Room.WAIT and delete == []


def test_no_store_no_room_is_no_room():
    verdict, delete = plan_room(tags(1, 2), None, set(), [], 50, 100, keep_local=2)
    assert verdict == Room.NO_ROOM and delete == []  # without a store the local tags are the only copy


def test_failed_upload_superseded_and_resume_source_are_safe():
    safe = diskroom.safe_to_delete(tags(1, 2, 3), {"step3"}, {"step1"})
    assert [t.name for t in safe] == ["step1", "step2", "step3"]  # step2: older than an uploaded tag


def test_tag_bytes_survives_the_uploader_deleting_the_tag_mid_walk(tmp_path, monkeypatch):
    """The uploader's thread deletes a superseded tag while the ranks measure (a CI run died on it):
    what vanished counts 0, no FileNotFoundError reaches the rank."""
    tag = tmp_path / "step2"
    (tag / "global_step2").mkdir(parents=True)
    (tag / "state.json").write_bytes(b"x" * 10)
    (tag / "global_step2" / "optim.pt").write_bytes(b"x" * 100)
    assert diskroom.tag_bytes(tag) == 110
    real_walk = os.walk

    def walk_while_deleted(path):
        for entry in real_walk(path):
            shutil.rmtree(tag, ignore_errors=True)  # gone between the listing and the stat
            yield entry

    monkeypatch.setattr(diskroom.os, "walk", walk_while_deleted)
    assert diskroom.tag_bytes(tag) == 0
    assert diskroom.tag_bytes(tmp_path / "never-there") == 0


def test_expected_save_bytes_agrees_with_plan():
    seed = PlanInput(model="deepseek-7b", precision="fp16", gpu_mem_gb=24)
    params = seed.dims.params
    node0 = diskroom.expected_save_bytes(params, "fp16", world=3, local_world=3, node_rank=0)
    assert node0 / GB == pytest.approx(node_requirements(seed).checkpoint_gb, rel=1e-9)
    assert diskroom.expected_save_bytes(params, "fp16", 6, 3, node_rank=1) == 3 * 12 * (params // 6)


# -- run.json knobs ---------------------------------------------------------------------------------
def run_json(**extra) -> dict:
    return {"ds_config": "ds_config.json", "train": {}, **extra}


def test_collective_timeout_from_run_json_and_env(tmp_path, monkeypatch):
    monkeypatch.delenv("GPUCTL_COLLECTIVE_TIMEOUT_S", raising=False)
    assert parse_run_config(run_json(), tmp_path).collective_timeout_s == DEFAULT_COLLECTIVE_TIMEOUT_S
    assert parse_run_config(run_json(collective_timeout_s=45), tmp_path).collective_timeout_s == 45
    monkeypatch.setenv("GPUCTL_COLLECTIVE_TIMEOUT_S", "90")
    assert parse_run_config(run_json(collective_timeout_s=45), tmp_path).collective_timeout_s == 90
    monkeypatch.setenv("GPUCTL_COLLECTIVE_TIMEOUT_S", "soon")
    with pytest.raises(TrainerError, match="GPUCTL_COLLECTIVE_TIMEOUT_S must be a whole number"):
        parse_run_config(run_json(), tmp_path)
    monkeypatch.delenv("GPUCTL_COLLECTIVE_TIMEOUT_S")
    for bad in (0, -5, True, "x"):
        with pytest.raises(TrainerError, match="collective_timeout_s"):
            parse_run_config(run_json(collective_timeout_s=bad), tmp_path)


# -- tokenizer --------------------------------------------------------------------------------------
def deepseek_style_tokenizer(path: Path, decoder: bool = True) -> Path:
    """A ByteLevel BPE tokenizer.json labelled LlamaTokenizerFast, as DeepSeek's 7B ships it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if decoder:
        tok.decoder = decoders.ByteLevel()
    text = (REPO / "trainer" / "data" / "sample.txt").read_text().splitlines()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<bos>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(text, trainer)
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>", "legacy": True}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_deepseek_style_tokenizer_round_trips(tmp_path):
    from trainer.config import TrainConfig
    from trainer.tokenizer import load_tokenizer, round_trips

    tok = load_tokenizer(TrainConfig(model=str(deepseek_style_tokenizer(tmp_path / "tok"))))
    assert round_trips(tok)
    assert tok.decode(tok.encode("hello world", add_special_tokens=False)) == "hello world"


def test_tokenizer_that_mangles_text_is_one_line(tmp_path):
    from trainer.config import TrainConfig
    from trainer.tokenizer import load_tokenizer

    broken = deepseek_style_tokenizer(tmp_path / "tok", decoder=False)  # decode leaves byte markers in
    with pytest.raises(TrainerError, match="does not round-trip text under transformers") as err:
        load_tokenizer(TrainConfig(model=str(broken)))
    assert "\n" not in str(err.value)


# -- what render gives a GPU node --------------------------------------------------------------------
DS_PARSE = """
import json, os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1",
                  LOCAL_RANK="0", DS_ACCELERATOR="cpu")
import deepspeed
from deepspeed.runtime.config import DeepSpeedConfig
deepspeed.init_distributed(dist_backend="gloo")

class DataParallel:
    def get_data_parallel_world_size(self):
        return 3

z = DeepSpeedConfig(sys.argv[1], mpu=DataParallel()).zero_config
print(json.dumps({"rr": z.round_robin_gradients, "pin": z.offload_optimizer.pin_memory,
                  "device": str(z.offload_optimizer.device), "overlap": z.overlap_comm}))
"""


def test_gpu_node_bundle_ds_config_env_and_timeout(tmp_path):
    cfg = GpuctlConfig.model_validate(
        {
            "train": {
                "model": "deepseek-7b",
                "precision": "fp16",
                "grad_accum": 4,
                "seq_len": 2048,
                "gradient_checkpointing": True,
            }
        }
    )
    spec = BundleSpec(
        run_id="r",
        run_dir=str(tmp_path),
        nodes=[BundleNode("localhost", 3)],
        python="python3",
        accelerator="cuda",  # a GPU stand-in: what gpuctl renders for the seed node
        gpu_name="NVIDIA GeForce RTX 4090",
    )
    render_bundle(cfg, spec, tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", DS_PARSE, str(tmp_path / "ds_config.json"), str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "rr": True,
        "pin": True,  # the trainer keeps it only where torch pins exact-size
        "device": "cpu",
        "overlap": True,
    }
    launch = (tmp_path / "launch.sh").read_text()
    assert "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in launch
    assert "OMP_NUM_THREADS" not in launch  # each rank takes its share of the cores itself
    assert "NCCL_P2P_DISABLE" in launch
    assert json.loads((tmp_path / "run.json").read_text())["collective_timeout_s"] == 5820


def test_cpu_bundle_keeps_one_thread_and_the_floor_timeout(tmp_path):
    cfg = GpuctlConfig.model_validate({})
    spec = BundleSpec(run_id="r", run_dir=str(tmp_path), nodes=[BundleNode("localhost", 2)], python="python3")
    render_bundle(cfg, spec, tmp_path)
    launch = (tmp_path / "launch.sh").read_text()
    assert "export OMP_NUM_THREADS=1" in launch and "PYTORCH_CUDA_ALLOC_CONF" not in launch
    assert json.loads((tmp_path / "run.json").read_text())["collective_timeout_s"] == DEFAULT_COLLECTIVE_TIMEOUT_S


def test_metrics_line_shows_the_loss_scale():
    from trainer.metrics import StepRecord

    rec = StepRecord(1, 2.0, 1e-4, 10, 5.0, 1.0, 0.0, None, None, skipped=True, loss_scale=32768.0, skipped_steps=3)
    assert "scale 32768 skipped 3" in rec.line(10) and "overflow" in rec.line(10)
    assert "scale" not in StepRecord(1, 2.0, 1e-4, 10, 5.0, 1.0, 0.0, None, None).line(10)


# -- ckpt pull --hf says what it costs before it starts ---------------------------------------------
def test_pull_hf_says_the_download_and_ram_first(project, gpuctl):
    from trainer.objstore.store import CheckpointStore

    tag_dir = project / "local" / "step7"
    tag_dir.mkdir(parents=True)
    (tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"\0" * 1_400_000)
    (project / "gpuctl.yaml").write_text("storage: {url: ./store}\n")
    store = CheckpointStore.from_config({"url": (project / "store").as_uri()})
    store.upload_shards(tag_dir, "step7", 0, step=7)
    assert store.publish("step7", 7, 1, 1, timeout=5)
    out = gpuctl("ckpt", "pull", "step7", "--dest", "pulled", "--hf", "hf")
    said = out.stdout + out.stderr
    assert "--hf: downloads 0.0 GB, then zero_to_fp32 holds ~0.0 GB in RAM here" in said, said
    assert "python -m trainer.export <run dir>/checkpoints step7 OUT --dtype bf16" in said


def test_all_cores_widens_a_bound_rank_for_lone_work_then_narrows_it_back():
    code = (
        "import os; from trainer import hostenv; hostenv.bind_threads(); a = sorted(os.sched_getaffinity(0)); "
        "cm = hostenv.all_cores(); cm.__enter__(); b = sorted(os.sched_getaffinity(0)); cm.__exit__(None, None, None); "
        "print(a, b, sorted(os.sched_getaffinity(0)))"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(LOCAL_RANK="1", LOCAL_SIZE="2", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    bound, widened, back = (json.loads(x) for x in out.stdout.strip().replace("] [", "]|[").split("|"))
    assert widened == sorted(os.sched_getaffinity(0)) and back == bound
    assert len(bound) <= len(widened)


def test_offload_pinning_is_one_decision_for_both_strategies():
    assert pinning.pin_offload("cuda", exact=True)
    assert not pinning.pin_offload("cuda", exact=False)  # torch < 2.13: DeepSpeed's pin_memory off, FSDP's too
    assert not pinning.pin_offload("cpu", exact=True)  # CPU ranks: nothing to pin for

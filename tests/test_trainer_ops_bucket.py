"""DeepSpeed's compiled ops cached in the run's bucket (trainer/opscache.py), against a real S3 server
(moto) and DeepSpeed's real op build: a fresh node loads the bucket's build without a compiler; a
corrupt entry is compiled again and replaced, never loaded; a hostile tar is refused."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from tests.helpers import REPO
from trainer import opscache
from trainer.objstore.store import CheckpointStore

KEY = "torchX-dsY-cudanone-py3.11-x86-64-v3"  # fetch/publish take the key as given: no torch import here

# A node's ops step in its own process (as a rank runs it), then DeepSpeed's own load() of the op.
NODE = """
import json, sys, time
from trainer import opscache
from trainer.objstore.store import CheckpointStore
storage, root = json.loads(sys.argv[1]), sys.argv[2]
started = time.monotonic()
ops = opscache.prepare(CheckpointStore.from_config(storage).backend, ("cpu_adam",), print, root=root)
from deepspeed.accelerator import get_accelerator
module = get_accelerator().create_op_builder("CPUAdamBuilder").load()
print("RESULT", json.dumps({"ops": ops, "file": module.__file__, "adam": hasattr(module, "adam_update"),
                            "seconds": time.monotonic() - started}))
"""


def run_node(
    storage: dict,
    root: Path,
    env: dict[str, str] | None = None,
    timeout: float = 600,
    run_dir: Path | None = None,
    script: str = NODE,
) -> tuple[dict, str]:
    full = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(storage), str(root), str(run_dir or "")],
        capture_output=True, text=True, env=full, timeout=timeout, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(result.removeprefix("RESULT ")), proc.stdout


def built_op(op: str) -> Path:
    """An op this machine's DeepSpeed built already (the environment's op cache, see hostenv)."""
    from trainer.hostenv import ops_cache_default

    op_dir = Path(ops_cache_default(dict(os.environ))) / op
    if not (op_dir / f"{op}.so").is_file():
        pytest.skip(f"no {op} built in {op_dir} (a CPU run or the doctor's CPU Adam check builds it)")
    return op_dir


@pytest.fixture
def storage(s3_server, fresh_bucket) -> dict:
    return {"url": f"s3://{fresh_bucket}/runs/r1", "endpoint_url": s3_server.endpoint}


def node_key() -> str:
    arch = opscache.arch_target()
    if arch is None:
        pytest.skip("this CPU has no AVX2/FMA: the op cache does not apply")
    pytest.importorskip("deepspeed")
    return opscache.cache_key(arch)


def seed_from_first_run(backend, key: str, tmp_path: Path, ops: tuple[str, ...] = ("cpu_adam",)) -> None:
    """The first run's upload: this machine's built ops published under the node's key."""
    first = tmp_path / "first-node" / key
    first.mkdir(parents=True)
    for op in ops:
        shutil.copytree(built_op(op), first / op)
        opscache.publish(backend, op, key, first)


def test_a_fresh_node_loads_the_buckets_build_without_compiling(storage, tmp_path):
    backend = CheckpointStore.from_config(storage).backend
    key = node_key()
    seed_from_first_run(backend, key, tmp_path)
    assert CheckpointStore.from_config(storage).list() == []  # _ops/ is no checkpoint: ckpt ls, prune skip it
    fresh = tmp_path / "fresh-node"
    # No compiler: a build attempt would fail the run, so the op can only come from the bucket.
    result, out = run_node(storage, fresh, env={"CXX": "/bin/false", "CC": "/bin/false"}, timeout=180)
    assert re.search(rf"^ops: cache hit cpu_adam-{re.escape(key)} \(\d+\.\d s\)$", out, re.M), out
    assert result["ops"] == ["cpu_adam"] and result["adam"] is True
    assert result["file"] == str(fresh / key / "cpu_adam" / "cpu_adam.so")
    assert not list((fresh / key / "cpu_adam").glob("*.o"))  # fetched, not built
    # The node's next run: ready locally, no download, no line.
    again, out = run_node(storage, fresh, env={"CXX": "/bin/false"}, timeout=180)
    assert again["adam"] is True and "ops:" not in out


# A run's ops step as trainer/loop.py takes it (opscache.for_run), with rank 0's events: the live
# view's "ops" phase, its outcome, and the seconds summary.json keeps.
RUN = """
import json, os, sys
from pathlib import Path
from trainer import events, opscache
from trainer.objstore.store import CheckpointStore
storage, run_dir = json.loads(sys.argv[1]), Path(sys.argv[3])
events.start(run_dir, True)
offload = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
ops = opscache.for_run(CheckpointStore.from_config(storage), offload, print)
events.phase("first step")
events.first_step_done()
print("RESULT", json.dumps({"ops": ops, **events.summary_fields()}))
"""


def test_a_runs_ops_phase_says_cache_hit_and_is_timed(storage, tmp_path):
    backend = CheckpointStore.from_config(storage).backend
    key = node_key()
    seed_from_first_run(backend, key, tmp_path, ops=("cpu_adam", "deepspeed_shm_comm"))  # CPU ranks need both
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {"CXX": "/bin/false", "CC": "/bin/false", "GPUCTL_OPS_CACHE": "1", "GPUCTL_OPS_DIR": str(tmp_path / "n")}
    result, _out = run_node(storage, tmp_path / "unused", env=env, timeout=180, run_dir=run_dir, script=RUN)
    assert sorted(result["ops"]) == ["cpu_adam", "deepspeed_shm_comm"]
    assert result["phase_notes"] == {"ops": "deepspeed_shm_comm cache hit, cpu_adam cache hit"}
    assert 0 < result["phases"]["ops"] < 60 and "first step" in result["phases"]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["name"]) for e in events] == [("phase", "ops"), ("outcome", "ops"), ("phase", "first step")]
    assert "from the op cache, else compiled" in events[0]["detail"]


@pytest.mark.slow
def test_a_corrupt_entry_is_compiled_again_and_replaced_not_loaded(storage, s3_server, fresh_bucket, tmp_path):
    backend = CheckpointStore.from_config(storage).backend
    key = node_key()
    seed_from_first_run(backend, key, tmp_path)
    manifest = json.loads(backend.read_bytes(opscache.manifest_key("cpu_adam", key)))
    bad = tarfile_bytes({"cpu_adam/cpu_adam.so": b"not an ELF file"})
    s3_server.client().put_object(Bucket=fresh_bucket, Key=f"runs/r1/{manifest['object']}", Body=bad)
    started = time.monotonic()
    result, compiled = run_node(storage, tmp_path / "node2")  # the one real CPU Adam build of the tests
    compile_s = time.monotonic() - started
    assert f"ops: ignoring the cached cpu_adam-{key}: its tar is not the manifest's bytes" in compiled, compiled
    assert re.search(rf"^ops: compiled, uploaded cpu_adam-{re.escape(key)} \(\d+\.\d s\)$", compiled, re.M), compiled
    assert result["adam"] is True  # the corrupt .so would not import: this one was built here
    flags = (tmp_path / "node2" / key / "cpu_adam" / "build.ninja").read_text()
    assert "-march=x86-64-v3" in flags and "-D__AVX256__" in flags and "-march=native" not in flags  # portable
    fresh_manifest = json.loads(backend.read_bytes(opscache.manifest_key("cpu_adam", key)))
    assert fresh_manifest["object"] != manifest["object"]  # a new tar, then the manifest that names it
    # The rebuilt entry serves the next fresh node.
    started = time.monotonic()
    hit, out = run_node(storage, tmp_path / "node3", env={"CXX": "/bin/false"}, timeout=180)
    hit_s = time.monotonic() - started
    print(*(line for line in (compiled + out).splitlines() if line.startswith("ops: ")), sep="\n")
    print(f"node processes: compile {compile_s:.1f} s, cache hit {hit_s:.1f} s (imports and the op's load included)")
    assert f"ops: cache hit cpu_adam-{key}" in out and hit["adam"] is True


def tarfile_bytes(files: dict[str, bytes], links: dict[str, str] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tf.addfile(info)
    return buf.getvalue()


def put_entry(backend, tar: bytes, *, key: str = KEY, **manifest) -> None:
    """An entry as any holder of the bucket's key could write it (the manifest's sha256 is the tar's)."""
    import hashlib

    obj = f"_ops/cpu_adam-{key}-{'0' * 16}.tar"
    backend.write_bytes(obj, tar)
    m = {"format": 1, "op": "cpu_adam", "key": key, "object": obj, "size": len(tar)}
    m |= {"sha256": hashlib.sha256(tar).hexdigest()} | manifest
    backend.write_bytes(opscache.manifest_key("cpu_adam", KEY), json.dumps(m).encode())


SO = {"cpu_adam/cpu_adam.so": b"\x7fELF"}


@pytest.mark.parametrize(
    ("tar", "manifest", "reason"),
    [
        (tarfile_bytes({**SO, "cpu_adam/../../escaped.so": b"x"}), {}, "leaves the cpu_adam/ folder"),
        (tarfile_bytes({**SO, "/tmp/abs.so": b"x"}), {}, "leaves the cpu_adam/ folder"),
        (tarfile_bytes({}, links={"cpu_adam/cpu_adam.so": "/etc/passwd"}), {}, "is a link or device"),
        (tarfile_bytes({"cpu_adam/other.so": b"x"}), {}, "has no cpu_adam/cpu_adam.so"),
        (tarfile_bytes(SO), {"key": "torch0-ds0-cudanone-py3.11-x86-64-v4"}, "not this node's software"),
        (tarfile_bytes(SO), {"object": "runs/r0/step10/model.pt"}, "is not this entry's"),
        (tarfile_bytes(SO), {"size": 10**12}, "is not 1.."),
        (tarfile_bytes(SO), {"sha256": "0" * 64}, "is not the manifest's bytes"),
    ],
    ids=["dotdot", "absolute", "symlink", "no-op", "other-key", "other-object", "huge", "sha256"],
)
def test_a_hostile_or_mismatched_entry_is_refused_before_a_byte_is_unpacked(storage, tmp_path, tar, manifest, reason):
    backend = CheckpointStore.from_config(storage).backend
    put_entry(backend, tar, **manifest)
    folder = tmp_path / "node" / "ops"
    folder.mkdir(parents=True)
    with pytest.raises(opscache.BadEntry, match=re.escape(reason)):
        opscache.fetch(backend, "cpu_adam", KEY, folder)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["node", "ops"]  # nothing unpacked, nothing left


def test_no_entry_is_a_miss_and_a_refused_one_leaves_nothing_to_load(storage, tmp_path):
    backend = CheckpointStore.from_config(storage).backend
    folder = tmp_path / "ops"
    folder.mkdir()
    assert opscache.fetch(backend, "cpu_adam", KEY, folder) is False
    put_entry(backend, tarfile_bytes(SO), sha256="f" * 64)
    log: list[str] = []
    built: list[str] = []

    def compile_op(op: str, where: Path, arch: str) -> None:  # stands in for the real build (tested above)
        built.append(op)
        (where / op).mkdir()
        (where / op / f"{op}.so").write_bytes(b"built here")

    assert opscache.ensure(backend, "cpu_adam", KEY, folder, "x86-64-v3", log.append, compile_op) == "compiled"
    assert built == ["cpu_adam"] and (folder / "cpu_adam" / "cpu_adam.so").read_bytes() == b"built here"
    assert log[0].startswith(f"ops: ignoring the cached cpu_adam-{KEY}: its tar is not the manifest's bytes")
    assert log[1].startswith(f"ops: compiled, uploaded cpu_adam-{KEY} (")
    assert opscache.ensure(backend, "cpu_adam", KEY, tmp_path / "other", "x86-64-v3", log.append, compile_op) == "hit"


def test_the_cache_is_on_for_gpu_nodes_and_opt_in_on_cpu():
    assert opscache.enabled("cuda", {}) and not opscache.enabled("cuda", {"GPUCTL_OPS_CACHE": "0"})
    assert not opscache.enabled("cpu", {}) and opscache.enabled("cpu", {"GPUCTL_OPS_CACHE": "1"})


def test_a_cpu_without_avx2_keeps_deepspeeds_own_build(tmp_path):
    (tmp_path / "cpuinfo").write_text("processor : 0\nflags : fpu sse2 avx\n")
    assert opscache.arch_target(tmp_path / "cpuinfo") is None
    (tmp_path / "cpuinfo").write_text("processor : 0\nflags : fpu sse2 avx avx2 fma\n")
    assert opscache.arch_target(tmp_path / "cpuinfo") in (None, "x86-64-v3")  # None off x86-64


def test_two_first_runs_at_once_leave_one_complete_entry(storage, tmp_path):
    import threading

    nodes = []
    for i in range(2):  # two nodes that each built the op (different bytes, so the winner is known)
        folder = tmp_path / f"node{i}" / "ops"
        (folder / "cpu_adam").mkdir(parents=True)
        (folder / "cpu_adam" / "cpu_adam.so").write_bytes(f"build of node {i}".encode() * 100_000)
        nodes.append(folder)
    start, errors = threading.Barrier(2), []

    def upload(folder: Path) -> None:
        try:
            start.wait(timeout=30)
            opscache.publish(CheckpointStore.from_config(storage).backend, "cpu_adam", KEY, folder)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=upload, args=(folder,)) for folder in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == [] and not any(t.is_alive() for t in threads)
    fresh = tmp_path / "fresh" / "ops"
    assert opscache.fetch(CheckpointStore.from_config(storage).backend, "cpu_adam", KEY, fresh) is True
    got = (fresh / "cpu_adam" / "cpu_adam.so").read_bytes()
    assert got in {(n / "cpu_adam" / "cpu_adam.so").read_bytes() for n in nodes}  # one node's, whole

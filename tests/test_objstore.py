"""trainer.objstore against a local directory and a real S3-protocol server (moto_server
on loopback): round trips, multi-node publish, incremental upload, retention, fallback."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.s3server import venv_bin
from trainer.objstore.backends import StorageNotFound, VerificationError
from trainer.objstore.store import CheckpointStore
from trainer.objstore.uploader import BackgroundUploader

pytestmark = pytest.mark.timeout(120)

# Small parts so multipart code paths run on small files (5 MiB is S3's minimum part).
S3_TUNING = {
    "multipart_threshold": 6 << 20,
    "multipart_chunksize": 5 << 20,
    "max_attempts": 2,
    "connect_timeout": 2,
    "read_timeout": 20,
}


def write_files(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return root


def node_dirs(tmp: Path, tag: str, seed: int = 0, big: int = 0) -> tuple[Path, Path]:
    """Two simulated nodes' local copies of DeepSpeed save dir ``tag`` (disjoint shards)."""
    rnd = lambda n: os.urandom(n)  # noqa: E731
    n0 = write_files(
        tmp / f"node0-{seed}" / tag,
        {
            "mp_rank_00_model_states.pt": rnd(3000 + big),
            "zero_pp_rank_0_mp_rank_00_optim_states.pt": rnd(2000),
            "zero_pp_rank_1_mp_rank_00_optim_states.pt": rnd(2000),
        },
    )
    n1 = write_files(
        tmp / f"node1-{seed}" / tag,
        {
            "zero_pp_rank_2_mp_rank_00_optim_states.pt": rnd(2000),
            "zero_pp_rank_3_mp_rank_00_optim_states.pt": rnd(2000),
        },
    )
    return n0, n1


def publish_two_nodes(store: CheckpointStore, tmp: Path, tag: str, step: int, **kw) -> tuple[Path, Path]:
    n0, n1 = node_dirs(tmp, tag, seed=step, **kw)
    store.upload_shards(n0, tag, 0, step=step)
    store.upload_shards(n1, tag, 1, step=step)
    assert store.publish(tag, step, world_size=4, num_nodes=2, timeout=5)
    return n0, n1


class Lines(list):
    def __call__(self, line: str) -> None:
        self.append(line)

    def text(self) -> str:
        return "\n".join(self)


@pytest.fixture(params=["file", "s3"])
def kind(request):
    return request.param


@pytest.fixture
def make_store(kind, tmp_path, request):
    """make_store(keep=K) -> (store, raw) where raw pokes at objects behind the store's back."""
    if kind == "s3":
        server = request.getfixturevalue("s3_server")
        request.getfixturevalue("s3_env")

    def make(keep: int | None = 3, log=None):
        if kind == "file":
            root = tmp_path / f"store-{time.monotonic_ns()}"
            cfg = {"url": f"file://{root}", "keep": keep}
            raw = FileRaw(root)
        else:
            bucket = server.make_bucket()
            cfg = {"url": f"s3://{bucket}/runs/r1", "keep": keep, "endpoint_url": server.endpoint, **S3_TUNING}
            raw = S3Raw(server.client(), bucket, "runs/r1")
        raw.cfg = cfg  # to open the same store again, e.g. as another node
        return CheckpointStore.from_config(cfg, log=log), raw

    return make


class FileRaw:
    def __init__(self, root: Path):
        self.root = root

    def put(self, key: str, data: bytes) -> None:
        (self.root / key).write_bytes(data)

    def delete(self, key: str) -> None:
        (self.root / key).unlink()

    def exists(self, key: str) -> bool:
        return (self.root / key).exists()

    def keys(self) -> set[str]:
        return {p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file()}


class S3Raw:
    def __init__(self, client, bucket: str, prefix: str):
        self.c, self.bucket, self.prefix = client, bucket, prefix

    def put(self, key: str, data: bytes) -> None:
        self.c.put_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}", Body=data)

    def delete(self, key: str) -> None:
        self.c.delete_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")

    def exists(self, key: str) -> bool:
        return f"{self.prefix}/{key}" in {f"{self.prefix}/{k}" for k in self.keys()}

    def keys(self) -> set[str]:
        resp = self.c.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix + "/")
        return {o["Key"][len(self.prefix) + 1 :] for o in resp.get("Contents", [])}


# --------------------------------------------------------------------------- tests
def test_import_is_light():
    code = (
        "import sys, trainer.objstore; print('torch' in sys.modules, 'boto3' in sys.modules, 'botocore' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == ["False", "False", "False"]


def test_round_trip_two_nodes(make_store, tmp_path):
    store, raw = make_store()
    n0, n1 = node_dirs(tmp_path, "step10", big=7 << 20)  # node 0's big file goes multipart
    ticks = []
    store.upload_shards(n0, "step10", 0, progress=lambda d, t: ticks.append((d, t)), step=10)
    assert ticks[-1][0] == ticks[-1][1] == sum(p.stat().st_size for p in n0.iterdir())

    [info] = store.list()
    assert (info.tag, info.complete, info.num_nodes, info.step) == ("step10", False, 1, 10)
    assert store.latest() is None

    result = {}
    publisher = threading.Thread(
        target=lambda: result.update(ok=store.publish("step10", 10, world_size=4, num_nodes=2, timeout=30))
    )
    publisher.start()
    time.sleep(0.5)
    assert publisher.is_alive(), "publish must wait for node 1"
    assert store.latest() is None and not raw.exists("latest")
    store.upload_shards(n1, "step10", 1, step=10)
    publisher.join(timeout=30)
    assert result == {"ok": True}

    latest = store.latest()
    assert latest is not None and latest.complete
    assert (latest.tag, latest.step, latest.world_size, latest.num_nodes) == ("step10", 10, 4, 2)
    expected = {p.name: p.read_bytes() for d in (n0, n1) for p in d.iterdir()}
    assert {f.path for f in latest.files} == set(expected)
    assert latest.size == sum(len(b) for b in expected.values())
    assert {"step10/manifest.json", "step10/_nodes/0.json", "step10/_nodes/1.json", "latest"} <= raw.keys()

    dl = []
    got = store.download(None, tmp_path / "dl", progress=lambda d, t: dl.append((d, t)))
    assert got.tag == "step10"
    assert (tmp_path / "dl" / "latest").read_text() == "step10"
    assert {p.name: p.read_bytes() for p in (tmp_path / "dl" / "step10").iterdir()} == expected
    assert dl[-1] == (latest.size, latest.size)


def test_publish_times_out_without_all_nodes(make_store, tmp_path):
    lines = Lines()
    store, raw = make_store(log=lines)
    n0, _ = node_dirs(tmp_path, "step10")
    store.upload_shards(n0, "step10", 0)
    t0 = time.monotonic()
    assert store.publish("step10", 10, 4, 2, timeout=0.6) is False
    assert time.monotonic() - t0 < 5
    assert "node(s) [1]" in lines.text()
    assert store.latest() is None and not raw.exists("step10/manifest.json")


def test_publish_counts_only_the_markers_of_its_own_attempt(make_store, tmp_path):
    """A recovered run saves again a tag its lost attempt half uploaded: node 1's marker from that attempt
    must not be published beside node 0's new files (a full run failed on it: "different contents")."""
    lines = Lines()
    lost, raw = make_store(log=lines)
    lost.attempt = "a"
    n0, n1 = node_dirs(tmp_path, "step4")
    (n1 / "metrics.jsonl").write_text("steps of attempt a\n")
    lost.upload_shards(n1, "step4", 1, step=4)  # node 1 got its marker in; node 0 never did
    store = CheckpointStore.from_config(raw.cfg, log=lines)
    store.attempt = "b"
    (n0 / "metrics.jsonl").write_text("steps of attempt b\n")
    store.upload_shards(n0, "step4", 0, step=4)
    assert store.publish("step4", 4, 4, 2, timeout=0.6) is False  # waits for node 1 of attempt b
    assert "node(s) [1]" in lines.text() and not raw.exists("step4/manifest.json")
    (n1 / "metrics.jsonl").write_text("steps of attempt b\n")
    store.upload_shards(n1, "step4", 1, step=4)
    assert store.publish("step4", 4, 4, 2, timeout=5) and store.latest().tag == "step4"
    again = CheckpointStore.from_config(raw.cfg, log=lines)
    again.attempt = "c"  # the same bytes from a later attempt: the markers are written anew, not kept
    again.upload_shards(n0, "step4", 0, step=4)
    again.upload_shards(n1, "step4", 1, step=4)
    assert again.publish("step4", 4, 4, 2, timeout=5)


def test_latest_only_moves_forward_and_list_is_newest_first(make_store, tmp_path):
    store, raw = make_store(keep=None)
    publish_two_nodes(store, tmp_path, "step20", 20)
    publish_two_nodes(store, tmp_path, "step10", 10)  # published late: latest stays step20
    node_dirs(tmp_path, "step30", seed=30)
    store.upload_shards(tmp_path / "node0-30" / "step30", "step30", 0, step=30)
    assert [(i.tag, i.complete) for i in store.list()] == [("step30", False), ("step20", True), ("step10", True)]
    assert store.latest().tag == "step20"


def test_retention_prunes_only_after_newer_is_complete(make_store, tmp_path):
    store, raw = make_store(keep=2)
    publish_two_nodes(store, tmp_path, "step10", 10)
    n0, _ = node_dirs(tmp_path, "step15", seed=15)
    store.upload_shards(n0, "step15", 0, step=15)  # abandoned: node 1 never comes
    publish_two_nodes(store, tmp_path, "step20", 20)
    assert {i.tag for i in store.list()} == {"step10", "step15", "step20"}

    n0, n1 = node_dirs(tmp_path, "step30", seed=30)
    store.upload_shards(n0, "step30", 0, step=30)
    store.upload_shards(n1, "step30", 1, step=30)
    # step30 fully uploaded but not yet complete: nothing is pruned yet
    assert {i.tag for i in store.list()} == {"step10", "step15", "step20", "step30"}
    assert store.publish("step30", 30, 4, 2, timeout=5)
    assert [(i.tag, i.complete) for i in store.list()] == [("step30", True), ("step20", True)]
    assert not any(k.startswith(("step10/", "step15/")) for k in raw.keys())
    assert store.latest().tag == "step30"


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_download_falls_back_on_bad_shard(make_store, tmp_path, damage):
    lines = Lines()
    store, raw = make_store(log=lines)
    publish_two_nodes(store, tmp_path, "step10", 10)
    publish_two_nodes(store, tmp_path, "step20", 20)
    key = "step20/zero_pp_rank_3_mp_rank_00_optim_states.pt"
    if damage == "corrupt":
        raw.put(key, b"\0" * 2000)  # same size, different bytes: only sha256 catches it
    else:
        raw.delete(key)

    got = store.download(None, tmp_path / "dl")
    assert got.tag == "step10"
    assert (tmp_path / "dl" / "latest").read_text() == "step10"
    assert not (tmp_path / "dl" / "step20").exists()
    assert sorted(p.name for p in (tmp_path / "dl" / "step10").iterdir()) == sorted(f.path for f in got.files)
    msg = lines.text()
    assert "step20" in msg and "falling back" in msg and "step10" in msg
    assert "zero_pp_rank_3" in msg


def test_download_without_any_good_checkpoint_raises(make_store, tmp_path):
    store, raw = make_store()
    with pytest.raises(StorageNotFound, match="no complete checkpoint"):
        store.download(None, tmp_path / "dl")
    publish_two_nodes(store, tmp_path, "step10", 10)
    raw.put("step10/mp_rank_00_model_states.pt", b"x")
    with pytest.raises(VerificationError, match="no older complete checkpoint"):
        store.download(None, tmp_path / "dl")


def test_download_explicit_tag_and_resume(make_store, tmp_path):
    store, raw = make_store()
    n0, n1 = publish_two_nodes(store, tmp_path, "step10", 10)
    publish_two_nodes(store, tmp_path, "step20", 20)
    dest = tmp_path / "dl"
    assert store.download("step10", dest).tag == "step10"
    assert (dest / "latest").read_text() == "step10"
    # A second pull finds every file already in place and transfers nothing.
    ticks = []
    store.download("step10", dest, progress=lambda d, t: ticks.append((d, t)))
    assert ticks[-1] == (0, 0)
    assert (dest / "step10" / "mp_rank_00_model_states.pt").read_bytes() == (
        n0 / "mp_rank_00_model_states.pt"
    ).read_bytes()


def test_changed_complete_checkpoint_is_unpublished_before_reupload(make_store, tmp_path):
    lines = Lines()
    store, raw = make_store(log=lines)
    publish_two_nodes(store, tmp_path, "step10", 10)
    n0, n1 = publish_two_nodes(store, tmp_path, "step20", 20)
    (n1 / "zero_pp_rank_2_mp_rank_00_optim_states.pt").write_bytes(os.urandom(2100))
    store.upload_shards(n1, "step20", 1, step=20)
    assert not raw.exists("step20/manifest.json")
    assert store.latest().tag == "step10"  # `latest` was moved back, never incomplete
    assert "un-publishing" in lines.text()
    assert store.publish("step20", 20, 4, 2, timeout=5)
    assert store.latest().tag == "step20"
    got = store.download(None, tmp_path / "dl")
    assert got.tag == "step20"
    assert (tmp_path / "dl/step20/zero_pp_rank_2_mp_rank_00_optim_states.pt").stat().st_size == 2100


def test_background_uploaders_two_nodes(make_store, tmp_path):
    store0, raw = make_store(keep=2)
    store1 = CheckpointStore.from_config(raw.cfg)  # node 1: its own store object
    logs0, logs1 = Lines(), Lines()
    up0 = BackgroundUploader(store0, node_rank=0, num_nodes=2, log=logs0, retry_deadline=30)
    up1 = BackgroundUploader(store1, node_rank=1, num_nodes=2, log=logs1, retry_deadline=30)
    for step in (10, 20, 30):
        n0, n1 = node_dirs(tmp_path, f"step{step}", seed=step)
        t0 = time.monotonic()
        up0.submit(n0, f"step{step}", step, world_size=4)
        up1.submit(n1, f"step{step}", step, world_size=4)
        assert time.monotonic() - t0 < 0.1, "submit must not block"
    up1.wait(timeout=60)
    up0.wait(timeout=60)
    assert up0.uploaded_tags() == up1.uploaded_tags() == {"step10", "step20", "step30"}
    assert [i.tag for i in store0.list()] == ["step30", "step20"]
    assert store0.latest().tag == "step30"
    assert "published" in logs0.text()
    up0.close(timeout=5)
    up1.close(timeout=5)


# --------------------------------------------------------------------------- S3 only
@pytest.fixture
def s3_store(s3_server, s3_env):
    def make(**extra):
        bucket = s3_server.make_bucket()
        cfg = {"url": f"s3://{bucket}/ckpt", "endpoint_url": s3_server.endpoint, "keep": 3, **S3_TUNING, **extra}
        return CheckpointStore.from_config(cfg), bucket

    return make


def count_requests(store) -> dict[str, int]:
    counts: dict[str, int] = {}

    def hook(model, **_):
        counts[model.name] = counts.get(model.name, 0) + 1

    store.backend.client.meta.events.register("before-call.s3", hook)
    return counts


def test_unchanged_files_are_not_uploaded_again(s3_store, tmp_path):
    store, _ = s3_store()
    files = {f"shard_{i:03d}.pt": os.urandom(1000 + i) for i in range(100)}
    files["big.pt"] = os.urandom(7 << 20)  # multipart
    src = write_files(tmp_path / "step10", files)
    counts = count_requests(store)
    store.upload_shards(src, "step10", 0)
    assert counts["PutObject"] == 100 + 1  # 100 small files + the node marker
    assert counts["UploadPart"] == 2 and counts["CreateMultipartUpload"] == 1

    for _ in range(2):  # how fast a no-op sync is: benchmarks/bench_storage.py, not a timed test
        counts.clear()
        store.upload_shards(src, "step10", 0)
        # the marker, the listing (whose ETags are the small files' MD5s), and the store's own
        # checksum of the multipart file (a replaced object goes up again)
        assert counts == {"GetObject": 1, "ListObjectsV2": 1, "HeadObject": 1}, counts

    (src / "shard_007.pt").write_bytes(os.urandom(1007))  # same size, new content
    counts.clear()
    store.upload_shards(src, "step10", 0)
    assert counts["PutObject"] == 2  # the changed file + the marker
    assert "UploadPart" not in counts


def test_objects_uploaded_before_a_crash_are_not_uploaded_again(s3_store, tmp_path):
    """The marker is written last; objects already there are recognised by their listed ETag
    (the MD5 of a small one-part object), with no request per file."""
    store, bucket = s3_store()
    src = write_files(tmp_path / "step10", {f"f{i}.pt": os.urandom(500) for i in range(5)})
    store.upload_shards(src, "step10", 0)
    store.backend.delete(["step10/_nodes/0.json"])
    counts = count_requests(store)
    store.upload_shards(src, "step10", 0)
    assert counts.get("PutObject") == 1 and "HeadObject" not in counts


def test_sha256_is_in_object_metadata(s3_store, s3_server, tmp_path):
    import hashlib

    store, bucket = s3_store()
    data = os.urandom(4096)
    src = write_files(tmp_path / "step1", {"a.pt": data})
    store.upload_shards(src, "step1", 0)
    head = s3_server.client().head_object(Bucket=bucket, Key="ckpt/step1/a.pt")
    assert head["Metadata"]["sha256"] == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("tool", ["aws", "s5cmd"])
def test_listing_visible_to_other_s3_clients(s3_store, s3_server, tmp_path, tool):
    exe = venv_bin(tool)
    if exe is None:
        pytest.skip(f"{tool} not installed")
    store, bucket = s3_store()
    publish_two_nodes(store, tmp_path, "step10", 10)
    if tool == "aws":
        cmd = [exe, "--endpoint-url", s3_server.endpoint, "s3", "ls", "--recursive", f"s3://{bucket}/ckpt/"]
    else:
        cmd = [exe, "--endpoint-url", s3_server.endpoint, "ls", f"s3://{bucket}/ckpt/*"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=os.environ)
    assert out.returncode == 0, out.stderr
    for name in (
        "ckpt/latest",
        "step10/manifest.json",
        "step10/_nodes/1.json",
        "step10/zero_pp_rank_3_mp_rank_00_optim_states.pt",
    ):
        assert name.split("ckpt/")[-1] in out.stdout, (name, out.stdout)

"""trainer.objstore.s3parts and s3download against moto_server on loopback: the upload keeps
its part buffers within max_buffer, a file downloaded in several ranges arrives whole and verified,
and a range cut mid-body goes on from where it stopped."""

from __future__ import annotations

import os
import threading

import pytest
from botocore.exceptions import ResponseStreamingError

from trainer.objstore import s3download
from trainer.objstore.backends import DownloadItem, Progress, VerificationError
from trainer.objstore.store import CheckpointStore

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
TUNING = {"multipart_threshold": 6 * MiB, "multipart_chunksize": 5 * MiB, "max_attempts": 2, "read_timeout": 20}


@pytest.fixture
def make_store(s3_server, s3_env):
    def make(**extra):
        bucket = s3_server.make_bucket()
        cfg = {"url": f"s3://{bucket}/ckpt", "endpoint_url": s3_server.endpoint, **TUNING, **extra}
        return CheckpointStore.from_config(cfg)

    return make


def save_dir(root, sizes: dict[str, int]):
    root.mkdir(parents=True)
    for name, size in sizes.items():
        (root / name).write_bytes(os.urandom(size))
    return root


def test_upload_keeps_part_buffers_within_max_buffer(make_store, tmp_path):
    store = make_store(max_buffer=11 * MiB, max_concurrency=8)  # room for two 5 MiB parts
    src = save_dir(tmp_path / "step1", {"a.pt": 23 * MiB, "b.pt": 17 * MiB, "c.pt": 3000})
    lock, in_flight, peak = threading.Lock(), [0], [0]

    def before(params, context, **_):  # the serialized request, its body in memory
        body = params["body"]  # botocore wraps our bytes in a BytesIO over the same buffer
        context["test_body_len"] = body.getbuffer().nbytes if hasattr(body, "getbuffer") else len(body)
        with lock:
            in_flight[0] += context["test_body_len"]
            peak[0] = max(peak[0], in_flight[0])

    def after(context, **_):
        with lock:
            in_flight[0] -= context["test_body_len"]

    events = store.backend.client.meta.events
    for op in ("UploadPart", "PutObject"):
        events.register(f"before-call.s3.{op}", before)
        events.register(f"after-call.s3.{op}", after)
    store.upload_shards(src, "step1", 0)
    assert store.publish("step1", 1, 1, 1, timeout=10)  # S3 kept the part checksums we sent
    assert 5 * MiB <= peak[0] <= 11 * MiB
    got = store.download("step1", tmp_path / "dl")
    assert got.tag == "step1"
    for name in ("a.pt", "b.pt", "c.pt"):
        assert (tmp_path / "dl/step1" / name).read_bytes() == (src / name).read_bytes()


def test_ranges_cover_each_file_once_and_share_the_connections():
    part = lambda size: 5 * MiB if size >= 6 * MiB else None  # noqa: E731
    items = [DownloadItem(k, None, size) for k, size in [("big", 3000 * MiB), ("mid", 1000 * MiB), ("s", 10)]]  # type: ignore[arg-type]
    ranges = s3download.ranges_for(items, part, concurrency=16)
    for it, rs in zip(items, ranges, strict=True):
        assert rs[0][0] == 0 and sum(n for _, n in rs) == it.size
        assert all(a + n == b for (a, n), (b, _) in zip(rs, rs[1:], strict=False))
    assert [len(r) for r in ranges] == [12, 4, 1]  # connections in proportion to size
    assert len(s3download.ranges_for(items[1:2], part, concurrency=16)[0]) == 15  # 1000 MiB / 64 MiB


@pytest.fixture
def small_ranges(monkeypatch):
    monkeypatch.setattr(s3download, "MIN_RANGE", 2 * MiB)
    monkeypatch.setattr(s3download, "STREAM_CHUNK", 256 << 10)


def test_a_file_in_several_ranges_arrives_whole_and_verified(make_store, tmp_path, small_ranges):
    store = make_store()
    src = save_dir(tmp_path / "step2", {"model.pt": 13 * MiB + 7, "optim.pt": 9 * MiB})
    store.upload_shards(src, "step2", 0)
    assert store.publish("step2", 2, 1, 1, timeout=10)
    gets = []
    store.backend.client.meta.events.register(
        "before-parameter-build.s3.GetObject", lambda params, **_: gets.append(params)
    )
    store.download("step2", tmp_path / "dl")
    assert sum(1 for p in gets if "Range" in p) >= 4
    for name in ("model.pt", "optim.pt"):
        assert (tmp_path / "dl/step2" / name).read_bytes() == (src / name).read_bytes()

    # The same object with one byte changed in its last range: the in-order hash catches it.
    client, key = store.backend.client, f"{store.backend.prefix}/step2/model.pt"
    data = bytearray((src / "model.pt").read_bytes())
    data[-1] ^= 0xFF
    client.put_object(Bucket=store.backend.bucket, Key=key, Body=bytes(data))
    dest = tmp_path / "dl2" / "model.pt"
    item = DownloadItem("step2/model.pt", dest, len(data))
    written = store.backend.download_files([item], Progress(None, len(data)))
    assert dest.read_bytes() == bytes(data)
    info = store.info("step2")
    assert info is not None
    assert written["step2/model.pt"] != next(f.sha256 for f in info.files if f.path == "model.pt")
    with pytest.raises(VerificationError):
        store.download("step2", tmp_path / "dl3")


def test_a_range_cut_mid_body_goes_on_from_where_it_stopped(make_store, tmp_path, small_ranges, s3_server):
    store = make_store()
    src = save_dir(tmp_path / "step3", {"model.pt": 12 * MiB})
    store.upload_shards(src, "step3", 0)
    assert store.publish("step3", 3, 1, 1, timeout=10)
    gets: list[str] = []
    cut = threading.Event()

    def on_get(params, **_):
        gets.append(params.get("Range", ""))

    def after_get(http_response, parsed, **_):
        """The first range's connection drops after two chunks are on disk (a fault in the
        response body: botocore has already returned, only our stream loop can go on)."""
        if cut.is_set() or not http_response.headers.get("Content-Range", "").startswith("bytes 0-"):
            return
        cut.set()
        stream = parsed["Body"]._raw_stream
        real_read, calls = stream.read, [0]

        def failing_read(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 3:
                raise ResponseStreamingError(error="connection reset by peer")
            return real_read(*args, **kwargs)

        stream.read = failing_read

    events = store.backend.client.meta.events
    events.register("before-parameter-build.s3.GetObject", on_get)
    events.register("after-call.s3.GetObject", after_get)
    store.download("step3", tmp_path / "dl")
    assert cut.is_set()
    assert (tmp_path / "dl/step3/model.pt").read_bytes() == (src / "model.pt").read_bytes()
    resumed = [r for r in gets if r.startswith("bytes=") and not r.startswith("bytes=0-")]
    first_range_end = next(r for r in gets if r.startswith("bytes=0-")).split("-")[1]
    assert any(r.endswith(f"-{first_range_end}") for r in resumed)  # the rest of the cut range


def test_a_store_without_checksums_is_vouched_for_by_etags_not_read_back(s3_env, tmp_path):
    """rclone serve s3 keeps no SHA256 checksums: the node records whole-file MD5s, and publish
    compares them with the listed ETags instead of downloading every file again."""
    from tests.s3server import RcloneS3

    with RcloneS3(tmp_path / "rclone") as server:
        bucket = server.make_bucket()
        cfg = {"url": f"s3://{bucket}/ckpt", "endpoint_url": server.endpoint, **TUNING}
        store = CheckpointStore.from_config(cfg)
        src = save_dir(tmp_path / "step4", {"model.pt": 13 * MiB, "optim.pt": 3 * MiB, "tiny.json": 300})
        store.upload_shards(src, "step4", 0)
        assert store.backend.keeps_checksums is False
        gets: list[str] = []
        store.backend.client.meta.events.register(
            "before-parameter-build.s3.GetObject", lambda params, **_: gets.append(params["Key"])
        )
        assert store.publish("step4", 4, 1, 1, timeout=10)
        assert not [k for k in gets if k.endswith((".pt", "tiny.json"))], gets

        # A file changed behind the marker has another ETag: read back, refused.
        (tmp_path / "evil").write_bytes(os.urandom(3 * MiB))
        store.backend.client.upload_file(str(tmp_path / "evil"), bucket, "ckpt/step4/optim.pt")
        with pytest.raises(VerificationError):
            store.publish("step4", 4, 1, 1, timeout=10)

        # A fresh process re-syncing the unchanged files keeps the checkpoint published.
        again = CheckpointStore.from_config(cfg)
        src2 = save_dir(tmp_path / "step5", {"model.pt": 7 * MiB})
        again.upload_shards(src2, "step5", 0)
        assert again.publish("step5", 5, 1, 1, timeout=10)
        fresh = CheckpointStore.from_config(cfg)
        fresh.upload_shards(src2, "step5", 0)
        assert fresh.latest() is not None and fresh.latest().tag == "step5"


@pytest.mark.parametrize("size", [1000, 13 * MiB])  # one GET; several ranged GETs
def test_an_object_longer_than_its_manifest_says_never_writes_past_that_size(make_store, tmp_path, small_ranges, size):
    store = make_store()
    src = save_dir(tmp_path / "step2", {"model.pt": size})
    store.upload_shards(src, "step2", 0)
    assert store.publish("step2", 2, 1, 1, timeout=10)
    # a hostile or broken store serves far more bytes under the key than the manifest names
    client, key = store.backend.client, f"{store.backend.prefix}/step2/model.pt"
    client.put_object(Bucket=store.backend.bucket, Key=key, Body=os.urandom(size + 6 * MiB))
    dest = tmp_path / "dl" / "model.pt"
    dest.parent.mkdir()
    item = DownloadItem("step2/model.pt", dest, size)
    if size < TUNING["multipart_threshold"]:  # a whole GET: the body is cut off at the manifest's size
        with pytest.raises(OSError, match="longer than its manifest says"):
            store.backend.download_files([item], Progress(None, size))
    else:  # ranges name only the manifest's bytes; the verification then refuses the changed ones
        store.backend.download_files([item], Progress(None, size))
        with pytest.raises(VerificationError):
            store.download("step2", tmp_path / "dl2")
    assert dest.stat().st_size <= size

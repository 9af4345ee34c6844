"""The upload reads each file once and hashes the buffers it sends (no hashing pass first, no md5
pass after), on moto (keeps SHA256 checksums) and rclone serve s3 (keeps none). Bodies go with
a signed checksum header instead of a signed payload (botocore would hash every part again);
a body changed on the wire is caught by the upload (the store's checksum, or its ETag where it
keeps none) and sent again; a file changed after it was hashed is not completed. Publish lists
no object of the complete checkpoints."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainer.objstore.backends import Progress, UploadItem, VerificationError
from trainer.objstore.s3parts import CorruptUpload
from trainer.objstore.store import CheckpointStore

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
TUNING = {"multipart_threshold": 6 * MiB, "multipart_chunksize": 5 * MiB, "max_attempts": 1, "read_timeout": 20}


@pytest.fixture(params=["moto", "rclone"])
def make_store(request, s3_env, tmp_path_factory) -> Iterator:
    """A store factory on moto (the module's shared server) or on a fresh rclone serve s3."""
    with contextlib.ExitStack() as stack:
        if request.param == "moto":
            server = request.getfixturevalue("s3_server")
        else:
            from tests.s3server import RcloneS3

            server = stack.enter_context(RcloneS3(tmp_path_factory.mktemp("rclone")))

        def make() -> CheckpointStore:
            cfg = {"url": f"s3://{server.make_bucket()}/ckpt", "endpoint_url": server.endpoint, **TUNING}
            return CheckpointStore.from_config(cfg)

        make.kind = request.param  # type: ignore[attr-defined]
        yield make


def save_dir(root: Path, sizes: dict[str, int]) -> Path:
    root.mkdir(parents=True)
    for name, size in sizes.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(os.urandom(size))
    return root


def bytes_read() -> int:
    """Bytes this process has read through read(2)/pread(2), all threads, page cache or not."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def test_a_checkpoint_is_read_once_on_upload(make_store, tmp_path):
    sizes = {"model.pt": 13 * MiB + 5, "optim.pt": 9 * MiB, "extra/small.json": 3000, "extra/mid.bin": 2 * MiB}
    src = save_dir(tmp_path / "step3", sizes)
    store = make_store()
    _ = store.backend.client  # made before counting: the trainer makes it once per run
    before = bytes_read()
    store.upload_shards(src, "step3", 0)
    read = bytes_read() - before
    total = sum(sizes.values())
    assert total <= read < 1.2 * total, f"{read / total:.2f}x the checkpoint read to upload it"
    assert store.publish("step3", 3, 1, 1, timeout=10)  # the in-flight digests are the stored bytes'
    marker = store.read_json("step3/_nodes/0.json")
    files = marker["files"]
    assert set(files) == set(sizes)
    # a multipart file's composite of its parts' checksums, where the store keeps them (parts carry
    # none where it keeps none: hashing them would be wasted)
    assert ("s3_sha256" in files["model.pt"]) is (make_store.kind == "moto")
    assert "s3_sha256" not in files["extra/mid.bin"]
    assert store.backend.keeps_checksums is (make_store.kind == "moto")
    if make_store.kind == "rclone":  # no checksums kept: every file's md5, for its listed ETag
        assert all("md5" in f for f in files.values())
    else:  # the small file's, for its ETag; not the others': the store's checksums vouch for them
        assert "md5" in files["extra/small.json"] and "md5" not in files["extra/mid.bin"]
    got = store.download("step3", tmp_path / "dl")
    assert got.tag == "step3"
    for rel in sizes:
        assert (tmp_path / "dl/step3" / rel).read_bytes() == (src / rel).read_bytes()


@pytest.mark.parametrize("target", ["UploadPart", "PutObject"])
def test_a_body_changed_on_the_wire_is_never_published_and_goes_up_again(make_store, tmp_path, target):
    """Bodies go with a signed checksum header, not a signed payload. moto keeps a part's checksum
    (publish compares); rclone keeps none, so parts go without one (not hashed for nothing), and
    the stored file's ETag, its MD5, gives the flipped bit away as soon as the file is stored;
    so does a small file's (moto keeps a PutObject's checksum as sent, without checking it)."""
    store = make_store()
    seen: list[tuple[str, str, str]] = []
    flip = [True]

    def after_signing(request, operation_name, **_):  # registered after botocore's signer
        if operation_name in ("UploadPart", "PutObject"):
            seen.append((operation_name, request.headers["X-Amz-Content-SHA256"], request.headers["Authorization"]))
            data_file = "tiny.json" in request.url or "partNumber=2" in request.url
            if flip[0] and operation_name == target and data_file:
                body = bytearray(request.body.getvalue())
                body[100] ^= 1  # a bit flipped on the wire, after the request was signed
                request.data = bytes(body)

    store.backend.client.meta.events.register("request-created.s3", after_signing)
    src = save_dir(tmp_path / "step4", {"model.pt": 12 * MiB, "tiny.json": 500})
    if make_store.kind == "moto" and target == "UploadPart":  # moto does not check a checksum on receipt
        store.upload_shards(src, "step4", 0)  # (S3 does: BadDigest)
        with pytest.raises(VerificationError):  # its composite, made from the stored parts, gives it away
            store.publish("step4", 4, 1, 1, timeout=10)
    else:  # the ETag (the stored bytes' MD5) of a file that was md5'd: rclone's, and a small file's
        with pytest.raises(CorruptUpload) as caught:
            store.upload_shards(src, "step4", 0)
        assert caught.value.transient  # the uploader tries again
        name = "step4/model.pt" if target == "UploadPart" else "step4/tiny.json"
        assert name in str(caught.value) and name not in store.backend.list("step4/")
    assert store.latest() is None
    flip[0] = False
    store.upload_shards(src, "step4", 0)  # the next attempt (the failed one may have stopped before a part went)
    assert {op for op, _, _ in seen} == {"UploadPart", "PutObject"}
    assert all(payload == "UNSIGNED-PAYLOAD" for _, payload, _ in seen)  # botocore did not hash bodies again
    signed = {op for op, _, auth in seen if "x-amz-checksum-sha256" in auth}  # the body's sha256, signed
    assert signed == ({"UploadPart", "PutObject"} if make_store.kind == "moto" else {"PutObject"})
    assert store.publish("step4", 4, 1, 1, timeout=10)
    assert store.download("step4", tmp_path / "dl").tag == "step4"
    assert (tmp_path / "dl/step4/model.pt").read_bytes() == (src / "model.pt").read_bytes()


@pytest.mark.parametrize("size", [3 * MiB, 13 * MiB])  # one PUT; multipart
def test_a_file_changed_after_it_was_hashed_is_not_stored(make_store, tmp_path, size):
    store = make_store()
    src = save_dir(tmp_path / "step5", {"model.pt": size})
    item = UploadItem(src / "model.pt", "step5/model.pt", size, sha256="0" * 64)  # hashed before it changed
    with pytest.raises(OSError, match="changed while uploading"):
        store.backend.upload_files([item], Progress(None, size))
    assert "step5/model.pt" not in store.backend.list("step5/")
    if make_store.kind == "moto":  # the multipart upload was aborted, not left to be billed
        client, bucket = store.backend.client, store.backend.bucket
        assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")


def test_publishing_lists_no_object_of_the_complete_checkpoints(make_store, tmp_path):
    """rclone serve s3 hashes every object it lists: publish and pruning find the checkpoints
    by their folders and manifests, and list no object of a checkpoint that stays."""
    store = make_store()
    store.keep = 2
    lists: list[dict] = []
    store.backend.client.meta.events.register(
        "before-parameter-build.s3.ListObjectsV2", lambda params, **_: lists.append(dict(params))
    )
    for step in (1, 2, 3):
        src = save_dir(tmp_path / f"step{step}", {"model.pt": 7 * MiB, "tiny.json": 100})
        store.upload_shards(src, f"step{step}", 0)
        lists.clear()
        assert store.publish(f"step{step}", step, 1, 1, timeout=10)
        kept = {i.tag for i in store.list() if i.tag != f"step{step}"}
        for prefix in (p["Prefix"] for p in lists if "Delimiter" not in p):  # object listings:
            tag = prefix.removeprefix(f"{store.backend.prefix}/").split("/")[0]  # "": all of them
            assert tag and tag not in kept, prefix  # the new tag's, or a pruned one's (to delete it)
    assert [i.tag for i in store.list()] == ["step3", "step2"]  # step1 pruned
    assert store.latest().tag == "step3"

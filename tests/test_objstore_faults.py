"""Faults against a real S3-protocol server: the server goes away mid-upload and comes
back (with and without its data), access denied, wrong endpoint, missing bucket, bad
profile. Every wait is bounded; every server is a loopback subprocess."""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from pathlib import Path

import pytest

from tests.fakes.harness import wait_until
from tests.helpers import free_port
from tests.s3server import LatestWatcher, MotoS3
from trainer.objstore.backends import StorageAuthError, StorageError, StorageUnavailable, UploadError
from trainer.objstore.store import CheckpointStore
from trainer.objstore.uploader import BackgroundUploader

pytestmark = pytest.mark.timeout(180)

FAST_FAIL = {
    "max_attempts": 2,
    "connect_timeout": 1,
    "read_timeout": 10,
    "multipart_threshold": 6 << 20,
    "multipart_chunksize": 5 << 20,
    "max_concurrency": 2,
}


class Lines(list):
    def __call__(self, line: str) -> None:
        self.append(line)

    def text(self) -> str:
        return "\n".join(self)


def make_ckpt(root: Path, big_mb: int) -> Path:
    root.mkdir(parents=True)
    (root / "mp_rank_00_model_states.pt").write_bytes(os.urandom(big_mb << 20))
    for r in range(4):
        (root / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(os.urandom(4096))
    return root


@pytest.fixture
def proxied_server(s3_env, tmp_path):
    with MotoS3(proxy=True, log_dir=tmp_path) as server:
        yield server


def _uploader(store, log, **kw):
    return BackgroundUploader(
        store,
        node_rank=0,
        num_nodes=1,
        log=log,
        retry_deadline=90,
        backoff_initial=0.5,
        backoff_max=2.0,
        publish_timeout=30,
        **kw,
    )


def _kill_after_first_part(store, action) -> threading.Event:
    """Run ``action`` (in a thread) right after the first multipart part is stored."""
    fired = threading.Event()

    def hook(**_):
        if not fired.is_set():
            fired.set()
            threading.Thread(target=action, daemon=True).start()

    store.backend.client.meta.events.register("after-call.s3.UploadPart", hook)
    return fired


@pytest.mark.parametrize("mode", ["outage", "kill"])
def test_server_down_mid_upload_then_back(proxied_server, tmp_path, mode):
    """outage: the port refuses connections and live ones are cut, moto keeps its data.
    kill: moto is SIGKILLed after the first part and restarted empty on the same port
    (bucket re-created), so the retry must re-upload everything."""
    server = proxied_server
    bucket = server.make_bucket()
    lines = Lines()
    store = CheckpointStore.from_config(
        {"url": f"s3://{bucket}/run", "keep": 3, "endpoint_url": server.endpoint, **FAST_FAIL}
    )
    up = _uploader(store, lines)
    step10 = make_ckpt(tmp_path / "step10", big_mb=1)
    up.submit(step10, "step10", 10, world_size=1)
    up.wait(timeout=60)
    assert store.latest().tag == "step10"

    step20 = make_ckpt(tmp_path / "step20", big_mb=30)  # 6 parts of 5 MiB, 2 at a time
    fired = _kill_after_first_part(store, server.kill if mode == "kill" else server.outage)
    with LatestWatcher(server, bucket, "run") as watcher:
        t0 = time.monotonic()
        up.submit(step20, "step20", 20, world_size=1)
        assert time.monotonic() - t0 < 0.1  # training goes on
        assert fired.wait(timeout=60), "no part was uploaded"
        time.sleep(3)  # the store is down for a while; the uploader keeps retrying
        assert "step20" not in up.uploaded_tags()
        server.restart() if mode == "kill" else server.recover()
        if mode == "outage":
            assert store.latest().tag == "step10"  # nothing new is latest until complete
        up.wait(timeout=90)
        wait_until(lambda: watcher.seen[-1:] == ["step20"], 30, "the watcher to see step20 as latest", every=0.05)

    assert watcher.violations == []
    assert watcher.seen and watcher.seen[-1] == "step20", watcher.seen
    assert "cannot reach S3 endpoint" in lines.text()
    assert "step20" in up.uploaded_tags()
    assert "retrying" in lines.text(), lines
    latest = store.latest()
    assert latest.tag == "step20" and latest.complete
    got = store.download(None, tmp_path / "dl")
    assert got.tag == "step20"
    assert (tmp_path / "dl/step20/mp_rank_00_model_states.pt").read_bytes() == (
        step20 / "mp_rank_00_model_states.pt"
    ).read_bytes()
    if mode == "kill":
        assert [i.tag for i in store.list()] == ["step20"]  # step10 died with the old server
    else:
        assert [i.tag for i in store.list()] == ["step20", "step10"]
    up.close(timeout=10)


def test_uploader_gives_up_after_deadline_and_reports(s3_env, tmp_path):
    """The deadline counts from submission: three tags queued behind an outage all fail
    within ~retry_deadline, and close() (the trainer's final sync) raises."""
    port = free_port()  # nothing listens here
    store = CheckpointStore.from_config(
        {"url": "s3://bkt/run", "endpoint_url": f"http://127.0.0.1:{port}", "retry_deadline": 3, **FAST_FAIL}
    )
    lines = Lines()
    up = BackgroundUploader(store, 0, 1, log=lines, backoff_initial=0.3, backoff_max=1)
    assert up.retry_deadline == 3  # from the storage config
    for step in (1, 2, 3):
        up.submit(make_ckpt(tmp_path / f"step{step}", 0), f"step{step}", step, world_size=1)
    t0 = time.monotonic()
    with pytest.raises(UploadError, match=f"cannot reach S3 endpoint http://127.0.0.1:{port}") as info:
        up.wait(timeout=30)
    assert time.monotonic() - t0 < 15
    assert all(f"upload of step{s} failed" in str(info.value) for s in (1, 2, 3))
    assert up.uploaded_tags() == set()
    assert lines.text().count("retrying") >= 2
    with pytest.raises(UploadError):
        up.close(timeout=5)
    with pytest.raises(UploadError, match="closed"):
        up.submit(tmp_path / "step1", "step1", 1, world_size=1)


def test_missing_bucket_fails_fast(s3_env, tmp_path):
    with MotoS3() as server:
        store = CheckpointStore.from_config(
            {"url": "s3://no-such-bucket/run", "endpoint_url": server.endpoint, **FAST_FAIL}
        )
        up = BackgroundUploader(store, 0, 1, log=Lines(), retry_deadline=60)
        up.submit(make_ckpt(tmp_path / "step1", 0), "step1", 1, world_size=1)
        t0 = time.monotonic()
        with pytest.raises(UploadError, match="bucket 'no-such-bucket' does not exist"):
            up.wait(timeout=30)
        assert time.monotonic() - t0 < 10  # permanent: no retrying for a minute


SECRET = "SECRET-MARKER-3f9a1c-never-print-me"


def _all_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


def test_access_denied_is_clear_and_secret_free(s3_env, tmp_path, caplog, capsys):
    s3_env.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    caplog.set_level(logging.DEBUG)  # botocore's own debug logging included
    lines = Lines()
    with MotoS3(auth=True, log_dir=tmp_path) as server:  # moto checks keys: ours is unknown
        store = CheckpointStore.from_config(
            {"url": "s3://bkt/run", "endpoint_url": server.endpoint, **FAST_FAIL}, log=lines
        )
        with pytest.raises(StorageAuthError) as info:
            store.list()
        msg = str(info.value)
        assert "access denied for s3://bkt/run" in msg and server.endpoint in msg
        assert "AWS_PROFILE" in msg
        up = BackgroundUploader(store, 0, 1, log=lines, retry_deadline=60)
        up.submit(make_ckpt(tmp_path / "step1", 0), "step1", 1, world_size=1)
        with pytest.raises(UploadError) as up_info:
            up.close(timeout=30)
    out = capsys.readouterr()
    for text in (
        msg,
        _all_text(info.value),
        str(up_info.value),
        _all_text(up_info.value),
        lines.text(),
        caplog.text,
        out.out,
        out.err,
    ):
        assert SECRET not in text


def test_wrong_endpoint_is_clear_and_secret_free(s3_env, caplog):
    s3_env.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    caplog.set_level(logging.DEBUG)
    port = free_port()
    store = CheckpointStore.from_config(
        {"url": "s3://bkt/run", "endpoint_url": f"http://127.0.0.1:{port}", **FAST_FAIL}
    )
    t0 = time.monotonic()
    with pytest.raises(StorageUnavailable) as info:
        store.latest()
    assert time.monotonic() - t0 < 15
    msg = str(info.value)
    assert f"cannot reach S3 endpoint http://127.0.0.1:{port} for s3://bkt/run" in msg
    assert "endpoint_url" in msg
    assert SECRET not in _all_text(info.value) and SECRET not in caplog.text


def test_unknown_profile_is_clear(s3_env):
    store = CheckpointStore.from_config(
        {"url": "s3://bkt/run", "profile": "no-such-profile", "endpoint_url": "http://127.0.0.1:9"}
    )
    with pytest.raises(StorageAuthError, match="profile 'no-such-profile' not found"):
        store.list()


def test_bad_urls_are_rejected():
    for url in ("gs://bucket/x", "s3://", "file://relative/x", ""):
        with pytest.raises(ValueError):
            CheckpointStore.from_config({"url": url})
    with pytest.raises(ValueError, match="invalid checkpoint tag"):
        CheckpointStore.from_config({"url": "file:///tmp/x"}).info("../etc")


def test_errors_are_storage_errors():
    assert issubclass(UploadError, StorageError) and issubclass(StorageAuthError, StorageError)
    assert StorageUnavailable("x").transient and not StorageAuthError("x").transient

"""What comes back from a store is untrusted (every rented node holds its write key): a crafted
manifest cannot make `ckpt pull` or the node's resume download write outside the destination,
and `publish` counts a checkpoint only once the stored bytes match the sha256 each node recorded.
Real stores: a directory (file://) and moto's S3 server on loopback."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given
from hypothesis import settings as fuzz_settings
from hypothesis import strategies as hst
from typer.testing import CliRunner

from provision.cli.app import app
from trainer.objstore.backends import StorageError, UnsafeManifest, VerificationError
from trainer.objstore.store import CheckpointStore

pytestmark = pytest.mark.timeout(120)
RUNNER = CliRunner()
S3_TUNING = {"multipart_threshold": 6 << 20, "multipart_chunksize": 5 << 20, "max_attempts": 2}


class Raw:
    """Writes objects behind the store's back, as a hostile node with the write key could."""

    def __init__(self, kind: str, root: Path | None = None, client=None, bucket: str = "", prefix: str = ""):
        self.kind, self.root, self.client, self.bucket, self.prefix = kind, root, client, bucket, prefix

    def put(self, key: str, data: bytes) -> None:
        if self.kind == "file":
            path = Path(os.path.normpath(self.root / key))  # what a path with ".." names on disk
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        else:  # S3 keys are plain strings: "step5/../../x" is one object
            self.client.put_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}", Body=data)


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
    """(storage settings, raw writer) for an empty store of each kind."""
    if request.param == "file":
        root = tmp_path / "store" / "a" / "b" / "runs"
        return {"url": root.as_uri(), "keep": 5}, Raw("file", root=root)
    server = request.getfixturevalue("s3_server")
    request.getfixturevalue("s3_env")
    bucket = server.make_bucket()
    settings = {"url": f"s3://{bucket}/runs", "endpoint_url": server.endpoint, "keep": 5, **S3_TUNING}
    return settings, Raw("s3", client=server.client(), bucket=bucket, prefix="runs")


def publish_one(settings: dict, tmp: Path, tag: str, step: int, files: dict[str, bytes]) -> None:
    local = tmp / "node" / tag
    for rel, data in files.items():
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        (local / rel).write_bytes(data)
    st = CheckpointStore.from_config(settings)
    st.upload_shards(local, tag, 0, step=step)
    assert st.publish(tag, step, world_size=1, num_nodes=1, timeout=5)


def evil_manifest(tag: str, files: dict[str, bytes], step: int = 5) -> bytes:
    entries = {rel: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest(), "node": 0} for rel, d in files.items()}
    return json.dumps(
        {"format": 1, "tag": tag, "step": step, "world_size": 1, "num_nodes": 1, "time": 1.0, "files": entries}
    ).encode()


def project_config(project: Path, settings: dict) -> Path:
    storage = {k: v for k, v in settings.items() if k in ("url", "endpoint_url", "keep")}
    path = project / "gpuctl.yaml"
    path.write_text(yaml.safe_dump({"storage": storage}))
    return path


def files_under(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def error_line(result) -> str:
    assert result.exit_code != 0, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "(fix: " in errors[0], result.stderr
    return errors[0]


@pytest.mark.parametrize("how", ["tag", "latest"])
def test_a_manifest_whose_tag_climbs_out_is_refused_and_nothing_is_written(project, store, tmp_path, how):
    settings, raw = store
    publish_one(settings, tmp_path, "step3", 3, {"mp_rank_00_model_states.pt": b"good" * 100})
    payload = b"attacker bytes\n"
    raw.put("step5/../../../OUTSIDE/evil.txt", payload)  # where the crafted tag points
    raw.put("step5/manifest.json", evil_manifest("step5/../../../OUTSIDE", {"evil.txt": payload}))
    raw.put("latest", b"step5")
    config = project_config(project, settings)
    before = files_under(project)

    args = ["ckpt", "pull", "step5"] if how == "tag" else ["ckpt", "pull"]
    result = RUNNER.invoke(app, [*args, "--dest", "pull/checkpoints", "-c", str(config)])
    line = error_line(result)
    assert "manifest.json" in line and "is not the folder it sits in ('step5')" in line
    assert files_under(project) == before and not (project / "pull").exists()  # nothing written, not even dest
    assert not (project / "OUTSIDE").exists()  # where the crafted tag aimed (dest/step5/../../../OUTSIDE)
    ls = RUNNER.invoke(app, ["ckpt", "ls", "-c", str(config)])  # lists it, refused, with why
    assert ls.exit_code == 0 and "step5: refused, never pulled: " in ls.stdout, ls.output
    assert "is not the folder it sits in" in ls.stdout


@pytest.mark.parametrize("path", ["../escaped.txt", "a/../../escaped.txt", "/etc/escaped", "_nodes/0.json"])
def test_a_manifest_path_that_leaves_its_folder_is_refused_without_falling_back(store, tmp_path, path):
    settings, raw = store
    publish_one(settings, tmp_path, "step3", 3, {"mp_rank_00_model_states.pt": b"good" * 100})
    raw.put("step5/manifest.json", evil_manifest("step5", {path: b"x"}))
    dest = tmp_path / "dest"
    with pytest.raises(UnsafeManifest, match="manifest"):
        # the node's resume download (trainer.checkpoint.fetch_from_store) calls this very method
        CheckpointStore.from_config(settings).download("step5", dest)
    assert not dest.exists()  # no fallback to step3 either: a hostile manifest stops the pull


def test_a_symlinked_tag_folder_cannot_redirect_the_download(tmp_path):
    settings = {"url": (tmp_path / "bucket").as_uri()}
    publish_one(settings, tmp_path, "step3", 3, {"mp_rank_00_model_states.pt": b"good" * 100})
    dest, elsewhere = tmp_path / "dest", tmp_path / "elsewhere"
    dest.mkdir()
    elsewhere.mkdir()
    (dest / "step3").symlink_to(elsewhere)
    with pytest.raises(UnsafeManifest, match="outside"):
        CheckpointStore.from_config(settings).download("step3", dest)
    assert not list(elsewhere.iterdir())


@pytest.mark.parametrize(
    "broken",
    [
        {"size": -1},
        {"size": "12"},
        {"sha256": "not-hex"},
        {"world_size": 0},
        {"time": "soon"},
        {"files": []},
    ],
)
def test_manifests_of_the_wrong_shape_are_one_line_errors(project, tmp_path, broken):
    settings = {"url": (tmp_path / "bucket").as_uri()}
    raw = Raw("file", root=tmp_path / "bucket")
    manifest = json.loads(evil_manifest("step5", {"a.pt": b"x"}))
    for key, value in broken.items():
        if key in ("size", "sha256"):
            manifest["files"]["a.pt"][key] = value
        else:
            manifest[key] = value
    raw.put("step5/manifest.json", json.dumps(manifest).encode())
    raw.put("step5/a.pt", b"x")
    config = str(project_config(project, settings))
    line = error_line(RUNNER.invoke(app, ["ckpt", "pull", "step5", "-d", "pulled", "-c", config]))
    assert "step5/manifest.json" in line and not (project / "pulled").exists()
    ls = RUNNER.invoke(app, ["ckpt", "ls", "-c", config])
    assert ls.exit_code == 0 and "step5: refused, never pulled: " in ls.stdout and "step5/manifest.json" in ls.stdout


@pytest.mark.parametrize("size", [3000, 7 << 20], ids=["one-part", "multipart"])
def test_publish_refuses_a_stored_file_whose_bytes_changed(store, tmp_path, size):
    settings, raw = store
    local = tmp_path / "node" / "step7"
    local.mkdir(parents=True)
    data = os.urandom(size)
    (local / "mp_rank_00_model_states.pt").write_bytes(data)
    st = CheckpointStore.from_config(settings)
    st.upload_shards(local, "step7", 0, step=7)
    # same size, other bytes: a bit flip in the store, or a node rewriting a shard after its marker
    raw.put("step7/mp_rank_00_model_states.pt", bytes([data[0] ^ 1]) + data[1:])
    with pytest.raises(VerificationError, match="do not match the sha256"):
        st.publish("step7", 7, world_size=1, num_nodes=1, timeout=5)
    assert st.latest() is None and not st.list()[0].complete
    # the true bytes again (S3: a PUT without checksum, so publish reads the object back and hashes it)
    raw.put("step7/mp_rank_00_model_states.pt", data)
    assert st.publish("step7", 7, world_size=1, num_nodes=1, timeout=5)
    assert st.latest().tag == "step7"


def test_node_markers_with_unsafe_paths_are_never_published(tmp_path):
    settings = {"url": (tmp_path / "bucket").as_uri()}
    raw = Raw("file", root=tmp_path / "bucket")
    marker = {"format": 1, "tag": "step2", "node_rank": 0, "step": 2, "time": 1.0}
    marker["files"] = {"../../x": {"size": 1, "sha256": hashlib.sha256(b"x").hexdigest()}}
    raw.put("step2/_nodes/0.json", json.dumps(marker).encode())
    st = CheckpointStore.from_config(settings)
    with pytest.raises(UnsafeManifest, match="unsafe path"):
        st.publish("step2", 2, world_size=1, num_nodes=1, timeout=1)
    assert not (tmp_path / "bucket" / "step2" / "manifest.json").exists()
    assert [i.tag for i in st.list()] == ["step2"]  # listed as incomplete, its bad marker ignored


@pytest.mark.parametrize("size", [3000, 7 << 20], ids=["one-part", "multipart"])
def test_an_object_replaced_behind_the_marker_goes_up_again(store, tmp_path, size):
    """A resumed run saves the same tag again: the marker says the stored file is fine, the store
    says otherwise. The sync uploads it again, so the checkpoint publishes with the true bytes."""
    settings, raw = store
    local = tmp_path / "node" / "step4"
    local.mkdir(parents=True)
    data = os.urandom(size)
    (local / "mp_rank_00_model_states.pt").write_bytes(data)
    st = CheckpointStore.from_config(settings)
    st.upload_shards(local, "step4", 0, step=4)
    raw.put("step4/mp_rank_00_model_states.pt", b"\0" * size)
    st.upload_shards(local, "step4", 0, step=4)
    assert st.publish("step4", 4, world_size=1, num_nodes=1, timeout=5)
    st.download("step4", tmp_path / "pulled")
    assert (tmp_path / "pulled" / "step4" / "mp_rank_00_model_states.pt").read_bytes() == data


# -- ckpt pull / ls against odd names and one hostile manifest among good ones ---------------------
@pytest.mark.parametrize("name", ["\ud800.pt", "shard-\udcff.pt"])
def test_a_lone_surrogate_in_a_manifest_path_is_one_line(project, tmp_path, name):
    """JSON may spell a lone surrogate ("\\ud800"); no file system takes it (or, \\udcff, it would
    become a raw byte that is not UTF-8)."""
    settings = {"url": (tmp_path / "bucket").as_uri()}
    publish_one(settings, tmp_path, "step3", 3, {"mp_rank_00_model_states.pt": b"good" * 100})
    Raw("file", root=tmp_path / "bucket").put("step5/manifest.json", evil_manifest("step5", {name: b"x"}))
    config = str(project_config(project, settings))
    line = error_line(RUNNER.invoke(app, ["ckpt", "pull", "step5", "-d", "pulled", "-c", config]))
    assert "step5/manifest.json" in line and "not valid Unicode (a lone surrogate)" in line
    assert not (project / "pulled").exists()


LONGEST = {"ascii": "n" * 255, "two-byte": "é" * 127 + "n"}  # 255 bytes each: NAME_MAX


@pytest.mark.parametrize("name", list(LONGEST.values()), ids=list(LONGEST))
def test_a_255_byte_file_name_pulls(project, store, tmp_path, name):
    """The longest name a file system takes: the temporary name it lands under must fit too."""
    settings, raw = store
    publish_one(settings, tmp_path, "step3", 3, {"mp_rank_00_model_states.pt": b"good" * 100})
    data = os.urandom(3000)
    raw.put(f"step5/sub/{name}", data)
    raw.put("step5/manifest.json", evil_manifest("step5", {f"sub/{name}": data}))
    config = str(project_config(project, settings))
    result = RUNNER.invoke(app, ["ckpt", "pull", "step5", "-d", "pulled", "-c", config])
    assert result.exit_code == 0, result.output
    assert (project / "pulled" / "step5" / "sub" / name).read_bytes() == data
    assert files_under(project / "pulled") == {f"step5/sub/{name}", "latest"}  # no temporary left


def test_a_256_byte_file_name_is_refused_leaving_nothing(project, tmp_path):
    settings = {"url": (tmp_path / "bucket").as_uri()}
    publish_one(settings, tmp_path, "step3", 3, {"mp_rank_00_model_states.pt": b"good" * 100})
    name = "é" * 128  # 128 characters, 256 bytes
    Raw("file", root=tmp_path / "bucket").put("step5/manifest.json", evil_manifest("step5", {name: b"x"}))
    config = str(project_config(project, settings))
    line = error_line(RUNNER.invoke(app, ["ckpt", "pull", "step5", "-d", "pulled", "-c", config]))
    assert "unsafe path" in line and not (project / "pulled").exists()


def test_an_interrupted_pull_leaves_no_empty_folder(project, tmp_path):
    """Ctrl-C (here: from the progress callback, once bytes have landed) removes the folders the
    pull made while they hold no checked file; a verification failure already did."""
    settings = {"url": (tmp_path / "bucket").as_uri()}
    publish_one(settings, tmp_path, "step3", 3, {"mp_rank_00_model_states.pt": b"good" * 1000})

    def interrupt(done: int, total: int) -> None:
        if done:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        CheckpointStore.from_config(settings).download("step3", project / "pulled", progress=interrupt)
    assert not (project / "pulled").exists()


def test_one_hostile_manifest_does_not_block_the_good_tags(project, tmp_path):
    settings = {"url": (tmp_path / "bucket").as_uri()}
    publish_one(settings, tmp_path, "step3", 3, {"mp_rank_00_model_states.pt": b"good" * 100})
    Raw("file", root=tmp_path / "bucket").put("step5/manifest.json", evil_manifest("step5", {"../x": b"x"}))
    config = str(project_config(project, settings))

    ls = RUNNER.invoke(app, ["ckpt", "ls", "-c", config])
    assert ls.exit_code == 0, ls.output
    assert "step3 (latest)" in ls.stdout and "REFUSED" in ls.stdout
    why = [line for line in ls.stdout.splitlines() if line.startswith("step5: ")]
    assert len(why) == 1 and "refused, never pulled: " in why[0] and "unsafe path '../x'" in why[0], ls.stdout
    listed = json.loads(RUNNER.invoke(app, ["ckpt", "ls", "--json", "-c", config]).stdout)
    by_tag = {i["tag"]: i for i in listed}
    assert by_tag["step3"]["complete"] and by_tag["step3"]["refused"] is None
    assert not by_tag["step5"]["complete"] and "unsafe path" in by_tag["step5"]["refused"]

    for args in (["step3"], []):  # by name, and the latest complete
        result = RUNNER.invoke(app, ["ckpt", "pull", *args, "-d", "pulled", "-c", config])
        assert result.exit_code == 0 and "pulled step3" in result.stderr, result.output
    assert "unsafe path" in error_line(RUNNER.invoke(app, ["ckpt", "pull", "step5", "-d", "p5", "-c", config]))


# -- any manifest: listing never fails, the good tag still pulls, nothing lands outside dest --------
NAMES = hst.one_of(
    hst.text(hst.characters(exclude_categories=()), max_size=40),  # surrogates and controls included
    hst.sampled_from(["a.pt", "..", ".", "", "/abs.pt", "a/../../b", "_nodes/0.json", "manifest.json"]),
    hst.sampled_from(["n" * 255, "é" * 128, "d/" * 600 + "x", ".tmp-1-a"]),
)
JUNK = hst.one_of(
    hst.none(), hst.booleans(), hst.integers(-3, 2**70), hst.floats(), hst.text(max_size=20), hst.lists(hst.none())
)


@hst.composite
def manifests(draw) -> tuple[dict, dict[str, bytes]]:
    """A manifest of tag step5 and the objects written beside it, each part valid or junk."""
    files, stored = {}, {}
    for name in draw(hst.lists(NAMES, max_size=3)):
        data = draw(hst.binary(max_size=50))
        rec = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        for key in draw(hst.sets(hst.sampled_from(["size", "sha256"]))):
            rec[key] = draw(JUNK)
        files[name] = draw(hst.one_of(hst.just(rec), JUNK))
        stored[name] = data
    m = {"format": 1, "tag": "step5", "step": 5, "world_size": 1, "num_nodes": 1, "time": 1.0, "files": files}
    for key in draw(hst.sets(hst.sampled_from(["tag", "step", "world_size", "num_nodes", "time", "files"]))):
        m[key] = draw(hst.one_of(JUNK, hst.sampled_from(["step5/..", "../step5", "step3"])))
    return m, stored


@fuzz_settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=True,
)
@given(case=manifests())
def test_any_manifest_leaves_the_good_tags_listed_and_pullable(case):
    manifest, stored = case
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        settings = {"url": (root / "bucket").as_uri()}
        publish_one(settings, root, "step3", 3, {"mp_rank_00_model_states.pt": b"good" * 100})
        raw = Raw("file", root=root / "bucket")
        raw.put("step5/manifest.json", json.dumps(manifest).encode())
        for name, data in stored.items():
            try:
                raw.put(f"step5/{name}", data)
            except (OSError, ValueError):  # a name no file system takes: the manifest lists it anyway
                pass
        store = CheckpointStore.from_config(settings)
        infos = {i.tag: i for i in store.list()}
        assert infos["step3"].complete and infos["step3"].problem is None
        assert infos["step3"].files[0].path == "mp_rank_00_model_states.pt"
        store.download("step3", root / "good")
        assert files_under(root / "good") == {"step3/mp_rank_00_model_states.pt", "latest"}

        outside = {p for p in files_under(root) if not p.startswith(("good/", "dest/"))}
        try:
            got = store.download("step5", root / "dest")
        except StorageError:  # refused, or failed verification with nothing older... one line each
            assert not (root / "dest").exists() or files_under(root / "dest") == set()
        else:
            assert got.tag in ("step5", "step3")
        assert {p for p in files_under(root) if not p.startswith(("good/", "dest/"))} == outside

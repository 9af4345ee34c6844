"""Checkpoint storage in S3-compatible object storage or a local directory.

Used on the node (the trainer's background upload, resume) and on the laptop
(``gpuctl ckpt ls/pull``), so it never imports torch, and boto3 only when an s3://
store is first used.

The layout of a store (tags, node markers, manifests, `latest`) is in layout.py.

Upload is incremental: a local file whose object is listed with its size and whose bytes
the store vouches for (its listed ETag equals the file's md5, recorded for files up to 1 MiB
and, on a store that keeps no checksums, for all; else S3's SHA256 checksum, else the object's
sha256 metadata; file://: the stored file hashed) is skipped, so a no-op sync costs one GET
(marker), one LIST and one HEAD per large file. Local hashes are cached on (path, size,
mtime_ns). Publish counts a checkpoint only once every stored file matches its node's digests
(ETag, the store's checksum, or read back). Pruning
(``keep`` K, retention.py) removes older checkpoints only after a newer one is complete,
manifest first. Download (retention.py, fetch.py) verifies every file's size and sha256; on a missing or corrupt file it
logs a line and falls back to the previous complete checkpoint. It writes ``dest/<tag>/...``
and ``dest/latest`` (DeepSpeed's load_checkpoint layout). Manifests and markers read back are
checked first (layout.py): a hostile one is refused before anything is written.

Progress callbacks are ``progress(bytes_done, bytes_total)``.
"""

from __future__ import annotations

import builtins
import json
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from trainer.objstore.backends import (
    FileBackend,
    ObjectStat,
    Progress,
    ProgressFn,
    StorageError,
    UnsafeManifest,
    UploadItem,
    VerificationError,
    _hash_many,
    md5_files,
    part_checksums,
    small_md5s,
)
from trainer.objstore.layout import (
    FORMAT,
    LATEST,
    MANIFEST,
    MD5_RE,
    NODES_DIR,
    TAG_RE,
    CheckpointInfo,
    FileEntry,
    check_tag,
    dumps,
    file_record,
    local_files,
    manifest_info,
    marker_files,
    step_from_tag,
)
from trainer.objstore.markers import is_current, marker_key, wait_for_markers
from trainer.objstore.retention import download, prune
from trainer.objstore.s3 import S3Backend, S3Options

_log = logging.getLogger("gpuctl.objstore")


class CheckpointStore:
    """Checkpoints in one store root; see the module docstring for the layout."""

    def __init__(
        self,
        backend: FileBackend | S3Backend,
        keep: int | None = None,
        log: Callable[[str], None] | None = None,
        retry_deadline: float = 3600.0,
    ):
        self.backend = backend
        self.keep = keep if keep and keep > 0 else None
        self.retry_deadline = retry_deadline  # BackgroundUploader's default
        self.log = log if log is not None else _log.warning
        self.url = backend.url
        self.attempt: str | None = None  # the run attempt whose markers publish counts (markers.py)

    @classmethod
    def from_config(cls, storage: Mapping[str, Any], log: Callable[[str], None] | None = None) -> CheckpointStore:
        """storage = {"url": "file:///abs" | "s3://bucket/prefix", "endpoint_url", "region",
        "profile", "keep": K}; optional "retry_deadline" (s, how long BackgroundUploader
        retries one checkpoint, default 3600) and S3 tuning keys named as S3Options' fields:
        multipart_threshold, multipart_chunksize, max_buffer (bytes), max_concurrency, max_attempts
        (per request, botocore standard retry mode), connect_timeout, read_timeout (s).
        Credentials come from boto3's chain (env, profile, instance role), never from here."""
        url = storage.get("url") or ""
        parsed = urlparse(url)
        keep = storage.get("keep")
        deadline = float(storage.get("retry_deadline") or 3600.0)
        if parsed.scheme == "file" or (not parsed.scheme and url.startswith("/")):
            if parsed.netloc not in ("", "localhost"):
                raise ValueError(f"file:// storage url must be file:///abs/path, got {url!r}")
            return cls(FileBackend(Path(unquote(parsed.path))), keep=keep, log=log, retry_deadline=deadline)
        if parsed.scheme == "s3":
            if not parsed.netloc:
                raise ValueError(f"s3 storage url needs a bucket: s3://bucket/prefix, got {url!r}")
            tuning = {k: storage[k] for k in S3Options.__dataclass_fields__ if storage.get(k)}
            backend = S3Backend(
                parsed.netloc,
                parsed.path,
                storage.get("endpoint_url"),
                storage.get("region"),
                storage.get("profile"),
                S3Options(**tuning),
            )
            return cls(backend, keep=keep, log=log, retry_deadline=deadline)
        raise ValueError(f"unsupported storage url {url!r}: use file:///abs/path or s3://bucket/prefix")

    # -- reading -----------------------------------------------------------------------
    def read_json(self, key: str) -> dict[str, Any] | None:
        data = self.backend.read_bytes(key)
        if data is None:
            return None
        try:
            obj = json.loads(data)
        except ValueError:
            obj = None
        if not isinstance(obj, dict):  # not JSON, or JSON that is not an object
            self.log(f"ignoring unreadable {self.url}/{key}")
            return None
        return obj

    def _info_from_manifest(self, m: dict[str, Any], tag: str) -> CheckpointInfo:
        """The manifest found in folder ``tag``, checked (UnsafeManifest when it is not gpuctl's)."""
        return manifest_info(m, tag, f"{self.url}/{tag}/{MANIFEST}")

    def _incomplete_info(self, tag: str, objs: dict[str, ObjectStat]) -> CheckpointInfo:
        step, nodes = -1, 0
        files: dict[str, dict[str, Any]] = {}
        for key in sorted(k for k in objs if k.startswith(f"{tag}/{NODES_DIR}/")):
            marker = self.read_json(key)
            if not marker:
                continue
            try:
                files.update(marker_files(marker, f"{self.url}/{key}"))
            except UnsafeManifest as exc:
                self.log(f"ignoring {exc}")
                continue
            nodes += 1
            marker_step = marker.get("step")
            if isinstance(marker_step, int) and not isinstance(marker_step, bool):
                step = max(step, marker_step)
        prefix = f"{tag}/"
        data = {
            k[len(prefix) :]: s
            for k, s in objs.items()
            if k.startswith(prefix) and not k.startswith(f"{tag}/{NODES_DIR}/")
        }
        entries = [FileEntry(p, s.size, files.get(p, {}).get("sha256", "")) for p, s in sorted(data.items())]
        return CheckpointInfo(
            tag=tag,
            step=step if step >= 0 else step_from_tag(tag),
            world_size=0,
            num_nodes=nodes,
            complete=False,
            size=sum(e.size for e in entries),
            time=max((s.mtime for s in objs.values()), default=0.0),
            files=entries,
        )

    def list(self) -> builtins.list[CheckpointInfo]:
        """All checkpoints, complete and incomplete, newest (highest step, then time) first: a
        complete one from its manifest, only an incomplete one from the listing of its objects. A
        manifest that fails its checks is listed as incomplete, with the reason in ``problem``."""
        infos = []
        for tag in self.backend.folders():
            if not TAG_RE.match(tag) or tag in (LATEST, NODES_DIR):  # not a checkpoint gpuctl writes
                continue
            manifest = self.read_json(f"{tag}/{MANIFEST}")
            if manifest:
                try:
                    infos.append(self._info_from_manifest(manifest, tag))
                except UnsafeManifest as exc:  # one hostile manifest must not hide the others
                    refused = self._incomplete_info(tag, self.backend.list(f"{tag}/"))
                    refused.problem = str(exc)
                    infos.append(refused)
            elif objs := self.backend.list(f"{tag}/"):
                infos.append(self._incomplete_info(tag, objs))
        infos.sort(key=lambda i: (i.step, i.time), reverse=True)
        return infos

    def info(self, tag: str) -> CheckpointInfo | None:
        """The complete checkpoint ``tag`` (from its manifest), or None."""
        manifest = self.read_json(f"{check_tag(tag)}/{MANIFEST}")
        return self._info_from_manifest(manifest, tag) if manifest else None

    def latest(self) -> CheckpointInfo | None:
        """The newest complete checkpoint: the one `latest` names, else the newest manifest."""
        raw = self.backend.read_bytes(LATEST)
        tag = raw.decode("utf-8", "replace").strip() if raw else ""
        if tag and TAG_RE.match(tag):
            info = self.info(tag)
            if info:
                return info
        return next((i for i in self.list() if i.complete), None)

    # -- uploading ---------------------------------------------------------------------
    def upload_shards(
        self,
        local_tag_dir: Path,
        tag: str,
        node_rank: int,
        progress: ProgressFn | None = None,
        *,
        step: int | None = None,
    ) -> None:
        """Upload this node's files of ``tag`` (skipping unchanged ones), then its marker."""
        check_tag(tag)
        t0 = time.monotonic()
        local = local_files(Path(local_tag_dir))
        sizes = {rel: p.stat().st_size for rel, p in local.items()}
        key = marker_key(tag, node_rank)
        marker = self.read_json(key) or {}
        recorded = marker.get("files", {})
        remote = self.backend.list(f"{tag}/")

        # Only a file the store may already hold is hashed first: it is skipped when the store
        # vouches for its bytes (its checksum; a store without one: the object's sha256 metadata),
        # not on our marker's word: the object may have been replaced since, and publish would
        # then refuse the checkpoint (one HEAD per file, in parallel). Every other file is hashed
        # as it is sent, from the buffers the upload reads (read once).
        listed = {rel: p for rel, p in local.items() if (st := remote.get(f"{tag}/{rel}")) and st.size == sizes[rel]}
        composites = part_checksums(self.backend.part_size, listed, sizes)  # (fills _hash_many's cache)
        hashes = dict(zip(listed, _hash_many(list(listed.values())), strict=True))
        md5s = small_md5s(listed, sizes)
        for rel, rec in recorded.items() if isinstance(recorded, dict) else ():
            # The whole-file md5 our marker holds for these very bytes (a store without checksums)
            # still holds: the marker stays the same, and the listed ETag can vouch for the file.
            if rel in hashes and rel not in md5s and isinstance(rec, dict) and rec.get("sha256") == hashes[rel]:
                if isinstance(rec.get("md5"), str) and MD5_RE.match(rec["md5"]):
                    md5s[rel] = rec["md5"]

        # The listing's ETag is the MD5 of the stored bytes: no HEAD, no composite (uploads make none there).
        by_etag = {rel for rel in listed if rel in md5s and remote[f"{tag}/{rel}"].etag == md5s[rel]}

        def vouched(rel: str) -> bool:
            return rel in by_etag or self.backend.content_matches(
                f"{tag}/{rel}", sizes[rel], hashes[rel], composites.get(rel), read_back=False
            )

        with ThreadPoolExecutor(max_workers=max(1, min(16, len(listed)))) as pool:
            stored = {rel for rel, ok in zip(listed, pool.map(vouched, listed), strict=True) if ok}
        todo = {
            rel: UploadItem(path, f"{tag}/{rel}", sizes[rel], hashes.get(rel))
            for rel, path in local.items()
            if rel not in stored
        }

        new_files = {
            rel: file_record(sizes[rel], hashes[rel], None if rel in by_etag else composites.get(rel), md5s.get(rel))
            for rel in stored
        }
        if not todo and marker and recorded == new_files and is_current(self, marker):
            return  # no-op sync
        if f"{tag}/{MANIFEST}" in remote:
            self._unpublish(tag)
        if marker:
            self.backend.delete([key])  # publish must not count us in while we change
        prog = Progress(progress, sum(i.size for i in todo.values()))
        sent = self.backend.upload_files(list(todo.values()), prog)
        prog.finish()
        for rel, it in todo.items():
            got = sent[it.key]
            new_files[rel] = file_record(it.size, got.sha256, got.composite, got.md5)
        if self.backend.keeps_checksums is False:  # publish then compares listed ETags, no read-back
            no_md5 = {rel: local[rel] for rel, rec in new_files.items() if "md5" not in rec}
            for rel, md5 in md5_files(no_md5).items():
                new_files[rel]["md5"] = md5
        record = {
            "format": FORMAT,
            "tag": tag,
            "node_rank": node_rank,
            "step": step if step is not None else step_from_tag(tag),
            "time": time.time(),
            "files": new_files,
        }
        if self.attempt is not None:
            record["attempt"] = self.attempt
        self.backend.write_bytes(key, dumps(record))
        dt = time.monotonic() - t0
        _log.info(
            "uploaded %s node %d: %d files, %.1f MB in %.2f s (%d unchanged)",
            tag,
            node_rank,
            len(todo),
            prog.total / 1e6,
            dt,
            len(local) - len(todo),
        )

    def _unpublish(self, tag: str) -> None:
        """Make a complete checkpoint incomplete (it is about to change), keeping `latest` valid."""
        self.log(f"checkpoint {tag} in {self.url} is being re-uploaded: un-publishing it first")
        raw = self.backend.read_bytes(LATEST)
        if raw is not None and raw.decode("utf-8", "replace").strip() == tag:
            others = [i for i in self.list() if i.complete and i.tag != tag]
            if others:
                self.backend.write_bytes(LATEST, others[0].tag.encode())
            else:
                self.backend.delete([LATEST])
        self.backend.delete([f"{tag}/{MANIFEST}"])

    def publish(self, tag: str, step: int, world_size: int, num_nodes: int, timeout: float) -> bool:
        """Node 0: wait (up to ``timeout`` s) for every node's marker of ``tag``, write the
        manifest, then `latest`, then prune beyond ``keep``. False if nodes are missing."""
        check_tag(tag)
        markers, missing = wait_for_markers(self, tag, num_nodes, time.monotonic() + max(0.0, timeout))
        if missing:
            self.log(f"not publishing {tag}: node(s) {missing} did not finish uploading within {timeout:.1f} s")
            return False

        files: dict[str, dict[str, Any]] = {}
        composites: dict[str, str | None] = {}
        md5s: dict[str, str | None] = {}
        for rank, marker in sorted(markers.items()):
            for rel, f in marker_files(marker, f"{self.url}/{marker_key(tag, rank)}").items():
                prev = files.get(rel)
                if prev and prev["sha256"] != f["sha256"]:
                    raise StorageError(
                        f"checkpoint {tag}: nodes {prev['node']} and {rank} uploaded different contents for {rel}"
                    )
                files.setdefault(rel, {"size": f["size"], "sha256": f["sha256"], "node": rank})
                composites.setdefault(rel, f.get("s3_sha256"))
                md5s.setdefault(rel, f.get("md5"))
        remote = self.backend.list(f"{tag}/")
        bad = sorted(
            rel for rel, f in files.items() if (st := remote.get(f"{tag}/{rel}")) is None or st.size != f["size"]
        )
        if bad:
            raise StorageError(
                f"checkpoint {tag}: node markers list files that are missing or "
                f"of the wrong size in {self.url}: {bad[:5]}"
            )

        # Size is not enough: the stored bytes must be the ones each node hashed (README's promise).
        # One HEAD per file not vouched for by its listed ETag (a read-back where the store keeps no
        # checksum), in parallel.
        def matches(rel: str) -> bool:
            f = files[rel]
            if md5s[rel] and remote[f"{tag}/{rel}"].etag == md5s[rel]:
                return True  # the listing's ETag is the MD5 of the stored bytes: no HEAD
            return self.backend.content_matches(f"{tag}/{rel}", f["size"], f["sha256"], composites[rel])

        rels = sorted(files)
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(rels)))) as pool:
            corrupt = [rel for rel, ok in zip(rels, pool.map(matches, rels), strict=True) if not ok]
        if corrupt:
            raise VerificationError(
                f"checkpoint {tag}: stored files do not match the sha256 their node recorded "
                f"in {self.url}: {corrupt[:5]}; not publishing it"
            )
        self.backend.write_bytes(
            f"{tag}/{MANIFEST}",
            dumps(
                {
                    "format": FORMAT,
                    "tag": tag,
                    "step": step,
                    "world_size": world_size,
                    "num_nodes": num_nodes,
                    "time": time.time(),
                    "files": files,
                }
            ),
        )

        complete = [i for i in self.list() if i.complete]
        if not any(i.step > step for i in complete):
            self.backend.write_bytes(LATEST, tag.encode())
        self._prune(complete)
        return True

    def _prune(self, infos: builtins.list[CheckpointInfo] | None = None) -> None:
        """Keep the newest ``keep`` complete checkpoints (retention.prune)."""
        prune(self, infos)

    # -- downloading -------------------------------------------------------------------
    def download(self, tag: str | None, dest: Path, progress: ProgressFn | None = None) -> CheckpointInfo:
        """Download ``tag`` (None: the latest complete) into ``dest/<tag>`` and write
        ``dest/latest``. Falls back to older complete checkpoints if it fails verification
        (retention.download)."""
        return download(self, tag, dest, progress)

"""DeepSpeed's JIT ops (CPU Adam) cached in the run's bucket: compiled once, fetched by every later node.

A node booted from a stock PyTorch image (runtime: bootstrap) has DeepSpeed without prebuilt ops, so
the first run compiles CPU Adam: 1-2 minutes of g++ before the first step, on every fresh node. Here
the first node to compile uploads the build; every later node with the same software downloads it,
checks its size and sha256, and loads it without a compiler.

Key: torch, DeepSpeed, CUDA, Python and the CPU target (cache_key). The build is made portable the way
the image builds it (images/portable-cxx.sh): -march=x86-64-v3 (GPUCTL_CPU_ARCH) and 256-bit SIMD in
place of DeepSpeed's -march=native and the build host's widest SIMD, so one entry serves every
AVX2 host. A host without AVX2/FMA (or not x86-64) keeps DeepSpeed's own native JIT build, uncached.

Bucket layout, under the run's storage root (a name starting with "_" is no checkpoint tag: `ckpt ls`
and pruning never see it, like <tag>/_nodes)::

    _ops/<op>-<key>.json             {"format", "op", "key", "object", "size", "sha256"}, written LAST
    _ops/<op>-<key>-<nonce>.tar      the op's folder: <op>/<op>.so (+ build.ninja, ninja's logs)

Each uploader puts its own tar (a fresh nonce) before the manifest, so two first runs at once never
mix their bytes: whichever manifest lands last names a complete tar. The bucket is untrusted (every
rented node holds its write key): a manifest of the wrong shape or for another key, a tar whose bytes
are not the manifest's, or whose members leave <op>/, are links, or exceed the size bounds is logged,
ignored and rebuilt; nothing from it is loaded.

Locally the ops live in TORCH_EXTENSIONS_DIR/gpuctl-ops/<key>/<op>/ (GPUCTL_OPS_DIR/<key>/<op>/), apart from DeepSpeed's own JIT
folders (other flags there would make the two builds rebuild each other). One process per node does
the work (a file lock); every rank then loads the .so itself and hands it to DeepSpeed's op registry,
so DeepSpeed neither compiles nor runs ninja (whose timestamps a fresh install would make stale).
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import platform
import re
import secrets
import shutil
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from types import ModuleType
from typing import Any

from trainer.objstore.backends import DownloadItem, Progress, StorageError, UploadItem, sha256_file

FORMAT = 1
PREFIX = "_ops"
FOLDER = "gpuctl-ops"
STAMP = ".gpuctl-ops.json"  # in a local op folder: fetched and verified, or built here, for this key
BUILDERS = {"cpu_adam": "CPUAdamBuilder", "deepspeed_shm_comm": "ShareMemCommBuilder"}
MAX_TAR = 256 << 20  # bytes of one tar (CPU Adam's: ~20 MB)
MAX_UNPACKED = 512 << 20  # bytes of its members together
MAX_MEMBERS = 16
OBJECT_RE = re.compile(r"^_ops/[A-Za-z0-9._-]+-[0-9a-f]{16}\.tar$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
SKIP_SUFFIXES = (".o", ".lock")  # object files serve only ninja's incremental rebuild

Log = Callable[[str], None]


class BadEntry(Exception):
    """A cache entry that must not be loaded (its reason is the message)."""


def arch_target(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The portable CPU target the ops are built for, or None where the cache is not used."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        flags = next((line.split(":", 1)[1].split() for line in cpuinfo.open() if line.startswith("flags")), [])
    except OSError:
        return None
    return (os.environ.get("GPUCTL_CPU_ARCH") or "x86-64-v3") if {"avx2", "fma"} <= set(flags) else None


def cache_key(arch: str) -> str:
    """torch, DeepSpeed, CUDA, Python and the CPU target: what makes a built op load and run."""
    import deepspeed
    import torch

    cuda = torch.version.cuda or "none"
    raw = f"torch{torch.__version__}-ds{deepspeed.__version__}-cuda{cuda}-py{sys.version_info[0]}.{sys.version_info[1]}-{arch}"
    return re.sub(r"[^A-Za-z0-9._-]", "_", raw)


def manifest_key(op: str, key: str) -> str:
    return f"{PREFIX}/{op}-{key}.json"


def check_manifest(raw: bytes, op: str, key: str) -> dict[str, Any]:
    """The manifest's fields, checked: it is for this op and key, and names a tar of a sane size."""
    try:
        m = json.loads(raw)
    except ValueError:
        raise BadEntry("its manifest is not JSON") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise BadEntry("its manifest is not one gpuctl writes")
    if m.get("op") != op or m.get("key") != key:
        raise BadEntry(f"its manifest is for {m.get('op')!r} {m.get('key')!r}, not this node's software")
    size, sha, obj = m.get("size"), m.get("sha256"), m.get("object")
    if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= MAX_TAR:
        raise BadEntry(f"its size {size!r} is not 1..{MAX_TAR} bytes")
    if not isinstance(sha, str) or not SHA256_RE.match(sha):
        raise BadEntry("its sha256 is not 64 hex digits")
    if not isinstance(obj, str) or not OBJECT_RE.match(obj) or not obj.startswith(f"{PREFIX}/{op}-{key}-"):
        raise BadEntry(f"its object {obj!r} is not this entry's")
    return m


def safe_extract(tar: Path, dest: Path, op: str) -> None:
    """Unpack the entry's tar into dest: only plain files and folders under <op>/, bounded in count
    and size, and <op>/<op>.so among them; anything else is BadEntry before a byte is written."""
    with tarfile.open(tar, "r:") as tf:
        members = []
        total = 0
        for member in tf:
            if len(members) == MAX_MEMBERS:
                raise BadEntry(f"its tar has more than {MAX_MEMBERS} members")
            parts = PurePosixPath(member.name).parts
            if member.name.startswith("/") or ".." in parts or not parts or parts[0] != op:
                raise BadEntry(f"its tar member {member.name!r} leaves the {op}/ folder")
            if not (member.isfile() or member.isdir()):
                raise BadEntry(f"its tar member {member.name!r} is a link or device, not a file")
            total += member.size
            if total > MAX_UNPACKED:
                raise BadEntry(f"its tar unpacks to more than {MAX_UNPACKED} bytes")
            members.append(member)
        if f"{op}/{op}.so" not in {m.name for m in members if m.isfile()}:
            raise BadEntry(f"its tar has no {op}/{op}.so")
        if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4 / 3.12: the stdlib's own wall, after ours
            tf.extractall(dest, members=members, filter="data")
        else:
            tf.extractall(dest, members=members)


def fetch(backend: Any, op: str, key: str, folder: Path) -> bool:
    """Download, verify and unpack the bucket's entry into folder/<op>; False when there is none.
    BadEntry when it is there but must not be used."""
    raw = backend.read_bytes(manifest_key(op, key))
    if raw is None:
        return False
    m = check_manifest(raw, op, key)
    folder.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".fetch-", dir=folder))
    try:
        tar = work / "entry.tar"
        try:
            got = backend.download_files([DownloadItem(m["object"], tar, m["size"])], Progress(None, m["size"]))
        except (StorageError, OSError) as exc:  # OSError: an object shorter than its manifest says
            raise BadEntry(f"its tar is not the manifest's bytes ({exc})") from None
        if tar.stat().st_size != m["size"] or got.get(m["object"]) != m["sha256"]:
            raise BadEntry(f"its tar is not the manifest's bytes (sha256 {got.get(m['object'])}, want {m['sha256']})")
        safe_extract(tar, work / "out", op)
        install(work / "out" / op, folder / op)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return True


def install(new: Path, target: Path) -> None:
    """Put the op folder new in target's place (an old one is moved aside first, then removed)."""
    old = target.with_name(f".old-{target.name}-{secrets.token_hex(4)}")
    if target.exists():
        target.rename(old)
    new.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def pack(op_dir: Path, tar: Path) -> None:
    """The op's folder as a tar of plain files under <op>/ (no object files, no lock, no stamp)."""
    with tarfile.open(tar, "w") as tf:
        for path in sorted(op_dir.iterdir()):
            if path.is_file() and not path.is_symlink() and path.suffix not in SKIP_SUFFIXES and path.name != STAMP:
                tf.add(path, arcname=f"{op_dir.name}/{path.name}", recursive=False)


def publish(backend: Any, op: str, key: str, folder: Path) -> str:
    """Upload folder/<op> as this key's entry: the tar under a fresh name, then the manifest naming it."""
    obj = f"{PREFIX}/{op}-{key}-{secrets.token_hex(8)}.tar"
    work = Path(tempfile.mkdtemp(prefix=".publish-", dir=folder))
    try:
        tar = work / "entry.tar"
        pack(folder / op, tar)
        size, sha = tar.stat().st_size, sha256_file(tar)
        backend.upload_files([UploadItem(tar, obj, size, sha)], Progress(None, size))
        m = {"format": FORMAT, "op": op, "key": key, "object": obj, "size": size, "sha256": sha}
        backend.write_bytes(manifest_key(op, key), json.dumps(m, sort_keys=True).encode())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return obj


def build(op: str, folder: Path, arch: str) -> None:
    """Compile the op into folder/<op> with DeepSpeed's builder, for the portable target (as the image's
    compiler wrapper does) instead of the build host's own CPU."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(BUILDERS[op])
    builder.cpu_arch = lambda: f"-march={arch}"  # DeepSpeed: -march=native
    builder.simd_width = lambda: "-D__AVX256__"  # DeepSpeed: the build host's widest (AVX-512 where it has it)
    saved = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(folder)  # torch builds into $TORCH_EXTENSIONS_DIR/<op>
    try:
        builder.jit_load(verbose=False)
    finally:
        if saved is None:
            os.environ.pop("TORCH_EXTENSIONS_DIR", None)
        else:
            os.environ["TORCH_EXTENSIONS_DIR"] = saved


def ensure(backend: Any, op: str, key: str, folder: Path, arch: str, log: Log, compile_op: Any = build) -> str:
    """folder/<op> fetched from the bucket, else compiled and uploaded; returns "hit" or "compiled".
    One line in the log either way."""
    name, started = f"{op}-{key}", time.monotonic()
    try:
        if fetch(backend, op, key, folder):
            (folder / op / STAMP).write_text(json.dumps({"key": key, "from": "bucket"}))
            log(f"ops: cache hit {name} ({time.monotonic() - started:.1f} s)")
            return "hit"
    except BadEntry as exc:
        log(f"ops: ignoring the cached {name}: {exc}; compiling it again")
    except StorageError as exc:
        log(f"ops: could not read the op cache ({exc}); compiling {op}")
    shutil.rmtree(folder / op, ignore_errors=True)  # nothing of a refused entry stays
    compile_op(op, folder, arch)
    (folder / op / STAMP).write_text(json.dumps({"key": key, "from": "compiled"}))
    try:
        publish(backend, op, key, folder)
    except (StorageError, OSError) as exc:
        log(f"ops: compiled {name} ({time.monotonic() - started:.1f} s); upload failed: {exc}")
        return "compiled"
    log(f"ops: compiled, uploaded {name} ({time.monotonic() - started:.1f} s)")
    return "compiled"


@contextmanager
def node_lock(folder: Path) -> Iterator[None]:
    """One process of the node at a time (the ranks of a node all call prepare)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def preload(op: str, folder: Path) -> ModuleType:
    """Load folder/<op>/<op>.so and register it as DeepSpeed's loaded op: its builder's load() returns
    this module without compiling or running ninja."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    spec = importlib.util.spec_from_file_location(op, folder / op / f"{op}.so")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {folder / op / f'{op}.so'}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    OpBuilder._loaded_ops[op] = module
    return module


def local_root(environ: dict[str, str] | None = None) -> Path:
    """Where a node keeps its cached ops: GPUCTL_OPS_DIR, else gpuctl-ops/ in TORCH_EXTENSIONS_DIR."""
    env = os.environ if environ is None else environ
    if env.get("GPUCTL_OPS_DIR"):
        return Path(env["GPUCTL_OPS_DIR"])
    return Path(env.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions") / FOLDER


def prepare(
    backend: Any, ops: tuple[str, ...], log: Log, root: str | None = None, outcomes: dict[str, str] | None = None
) -> list[str]:
    """Every op in ops ready and registered in this process (fetched or compiled once per node);
    returns the ops registered. Nothing happens where the cache does not apply (see arch_target).
    `outcomes` gets each op's way here: "hit", "compiled" or "on node" (fetched or built before)."""
    arch = arch_target()
    ops = tuple(op for op in ops if op in BUILDERS)
    if arch is None or not ops:
        return []
    key = cache_key(arch)
    folder = Path(root or local_root()) / key
    with node_lock(folder):
        for op in ops:
            if not (folder / op / STAMP).is_file() or not (folder / op / f"{op}.so").is_file():
                got = ensure(backend, op, key, folder, arch, log)
            else:
                got = "on node"
            if outcomes is not None:
                outcomes[op] = got
    for op in ops:
        preload(op, folder)
    return list(ops)


def enabled(accelerator: str, environ: dict[str, str] | None = None) -> bool:
    """On GPU nodes, unless GPUCTL_OPS_CACHE=0; on CPU ranks (tests, a laptop) only with GPUCTL_OPS_CACHE=1."""
    env = os.environ if environ is None else environ
    setting = env.get("GPUCTL_OPS_CACHE", "")
    return setting == "1" or (setting != "0" and accelerator != "cpu")


def for_run(store: Any, ds_config: dict, log: Log) -> list[str]:
    """The run's JIT ops (trainer.events.ops_needed) from the bucket of its storage, before DeepSpeed
    would compile them; [] when the run has no storage or the cache does not apply."""
    if store is None:
        return []
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    from trainer.events import ops_needed

    if not enabled(get_accelerator().device_name()) or arch_target() is None:
        return []
    ops = ops_needed(ds_config, at_init=False) + ops_needed(ds_config, at_init=True)
    ops = tuple(op for op in ops if not installed_ops.get(op) and op in BUILDERS)
    if not ops:
        return []
    from trainer import events

    # The live view's "ops" phase: its outcome (cache hit or compile) is said once it is known.
    events.phase("ops", f"{', '.join(ops)}: from the op cache, else compiled once", events.COMPILE_EXPECT_S)
    outcomes: dict[str, str] = {}
    done = prepare(store.backend, ops, log, outcomes=outcomes)
    events.outcome("ops", ", ".join(f"{op} {'cache hit' if how == 'hit' else how}" for op, how in outcomes.items()))
    return done

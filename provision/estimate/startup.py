"""Time to the first step of a new cloud node (pure): `up` prints it before renting, the run's summary puts
the measured phases beside it.

Four terms, each the phase the live view shows under the same name:
- image pull: the boot image's compressed bytes at the slower of the host's download and the engine's
  layer unpacking, plus the vendor's fixed start (schedule, container create, sshd); nothing to fetch
  when the host has the image cached (vendors cache their popular images; the offer does not say).
- node-side install (runtime bootstrap only): the pins' wheels (estimate/wheel_sizes.py) downloaded
  and unpacked, plus DeepSpeed's sdist build.
- ops: DeepSpeed's JIT ops, from the bucket's op cache (trainer/opscache.py: one ~20 MB tar) or compiled;
  nothing where the image has them prebuilt (the trainer image) or the run needs none.
- model download: the model's weights (parameter count x the checkpoint's bytes per parameter) from the
  Hugging Face Hub, and read from disk into memory; the built-in tiny model has no download.

Each rate is a figure with its source in RATES; a host's own download speed (Vast's offer `inet_down`)
replaces the default where the vendor gives one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

OpsState = Literal["hit", "miss", "unknown", "prebuilt", "none"]
MB = 1e6


@dataclass(frozen=True)
class Rates:
    """Rates of the model, each with where it comes from (the tuple's text)."""

    download_mbps: tuple[float, str] = (
        500.0,
        "assumed: the middle of Vast's listed inet_down for RTX 4090 hosts (100-2000 Mbit/s); "
        "Vast's own offer figure replaces it",
    )
    unpack_mb_s: tuple[float, str] = (
        120.0,
        "assumed: one gzip stream per layer (containerd/dockerd unpack layers single-threaded) "
        "at ~100-150 MB/s of compressed input",
    )
    vendor_start_s: tuple[float, str] = (
        45.0,
        "assumed: schedule + container create + sshd, what Vast and RunPod take for a cached image",
    )
    pip_unpack_mb_s: tuple[float, str] = (
        20.0,
        "assumed: pip install's unpack + byte-compile of wheels, MB of wheel per second on one core",
    )
    sdist_build_s: tuple[float, str] = (
        45.0,
        "measured: `pip wheel deepspeed==0.19.8 --no-deps --no-build-isolation` (DS_BUILD_OPS=0) took "
        "44.6 s on 2 shared x86 cores (2026-12-05); a rented node's cores take less",
    )
    compile_s: tuple[float, str] = (
        110.0,
        "measured: the first JIT build of DeepSpeed's CPU Adam on a few cores took 60-110 s "
        "(trainer/events.py COMPILE_EXPECT_S)",
    )
    cache_entry_mb: tuple[float, str] = (20.0, "trainer/opscache.py: CPU Adam's tar is ~20 MB")
    cache_fixed_s: tuple[float, str] = (5.0, "assumed: manifest read, sha256 and unpack of the tar")
    load_mb_s: tuple[float, str] = (
        1000.0,
        "assumed: safetensors/bin shards read from the node's local NVMe at ~1 GB/s",
    )


RATES = Rates()


@dataclass(frozen=True)
class StartupInput:
    image_gb: float | None  # compressed; None: unknown (a provider.image gpuctl has no figure for)
    image_cached: bool = False  # the host already has the image
    wheels_mb: float = 0.0  # runtime bootstrap: the pins' wheels; 0: nothing installed at boot
    sdist_builds: int = 0  # packages built from source at install (DeepSpeed)
    ops: OpsState = "unknown"  # the op cache for this key; unknown is counted as a miss
    model_bytes: float = 0.0  # weights downloaded from the Hub; 0: none (tiny, a local path)
    download_mbps: float | None = None  # the host's download, where the vendor says one


@dataclass(frozen=True)
class Term:
    name: str  # the live view's phase name
    seconds: float
    basis: str  # what the figure is made of, for the explanation


def with_rate(rates: Rates, download_mbps: float | None) -> Rates:
    if not download_mbps or download_mbps <= 0:
        return rates
    return replace(rates, download_mbps=(float(download_mbps), "the offer's own inet_down"))


def first_step(inp: StartupInput, rates: Rates = RATES) -> list[Term]:
    """The terms of the time to the first step, in the order they happen."""
    r = with_rate(rates, inp.download_mbps)
    net_mb_s = r.download_mbps[0] / 8
    terms = [_pull(inp, r, net_mb_s)]
    if inp.wheels_mb or inp.sdist_builds:
        fetch = inp.wheels_mb / net_mb_s + inp.wheels_mb / r.pip_unpack_mb_s[0]
        build = inp.sdist_builds * r.sdist_build_s[0]
        terms.append(
            Term(
                "node-side install",
                fetch + build,
                f"{inp.wheels_mb:,.0f} MB of wheels, {inp.sdist_builds} source build(s)",
            )
        )
    terms.append(_ops(inp, r, net_mb_s))
    if inp.model_bytes:
        mb = inp.model_bytes / MB
        terms.append(
            Term(
                "model download",
                mb / net_mb_s + mb / r.load_mb_s[0],
                f"{inp.model_bytes / 1e9:,.1f} GB of weights at {r.download_mbps[0]:,.0f} Mbit/s",
            )
        )
    return terms


def _pull(inp: StartupInput, r: Rates, net_mb_s: float) -> Term:
    start = r.vendor_start_s[0]
    if inp.image_cached:
        return Term("image pull", start, "image cached on the host")
    if inp.image_gb is None:
        return Term("image pull", start, "image size unknown: pull not counted")
    rate = min(net_mb_s, r.unpack_mb_s[0])
    return Term("image pull", start + inp.image_gb * 1e3 / rate, f"{inp.image_gb:g} GB at {rate:,.0f} MB/s")


def _ops(inp: StartupInput, r: Rates, net_mb_s: float) -> Term:
    if inp.ops in ("prebuilt", "none"):
        return Term("ops", 0.0, "prebuilt in the image" if inp.ops == "prebuilt" else "no JIT ops")
    if inp.ops == "hit":
        return Term("ops", r.cache_fixed_s[0] + r.cache_entry_mb[0] / net_mb_s, "op cache hit")
    why = "op cache miss" if inp.ops == "miss" else "op cache not checked, counted as a miss"
    return Term("ops", r.compile_s[0], f"{why} (compile)")


def total_s(terms: list[Term]) -> float:
    return sum(t.seconds for t in terms)


def minutes(seconds: float) -> str:
    return f"{max(1, round(seconds / 60))} min" if seconds >= 60 else f"{seconds:.0f} s"


def estimate_line(terms: list[Term]) -> str:
    """`up`'s line: "first step in ~N min (image pull 3 min: 10 GB at 62 MB/s; ...)"."""
    parts = "; ".join(f"{t.name} {minutes(t.seconds)}: {t.basis}" for t in terms)
    return f"first step in ~{minutes(total_s(terms))} ({parts})"


def beside(estimate: dict[str, float], measured: dict[str, float], notes: dict[str, str] | None = None) -> list[str]:
    """The summary's lines: each phase measured beside its estimate (either may be missing); `notes`:
    how a phase went (ops: cache hit or compiled)."""
    lines = []
    for name in dict.fromkeys([*estimate, *measured]):
        got, want = measured.get(name), estimate.get(name)
        m = f"{got:,.0f} s" if got is not None else "not measured"
        note = f", {notes[name]}" if notes and notes.get(name) else ""
        e = f" (estimate {want:,.0f} s)" if want is not None else ""
        lines.append(f"    {name}: {m}{note}{e}")
    return lines

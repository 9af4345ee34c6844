"""`gpuctl doctor`'s judgement: a node's facts (trainer/doctor.py) against what the run needs (pure).

Each rule turns facts into CheckRows: check | node | value | expected | status | fix. GPU rules
give "n/a" on CPU nodes. The facts come from a machine gpuctl does not own, as JSON: every value
is read through a type check, and a missing or odd one reads as "not measured".
"""

from __future__ import annotations

from typing import Any

from provision.core.checks import CheckRow, Status
from provision.estimate.doctor_rows import GB, Needs, Rows, get, num

MIN_SHM_GB = 1.0  # NCCL's per-peer buffers and the DataLoader's tensors; docker's default is 64 MB
CORES_PER_RANK = 2  # CPU Adam on a rank's partition wants cores of its own
CLOCK_WARN_S, CLOCK_FAIL_S = 5.0, 300.0  # S3 refuses requests signed 15 minutes off; logs mislead well before
MIN_STORE_MBPS = 20.0  # below this a 7B checkpoint (97 GB per node) takes over 80 minutes to upload


def _gb(nbytes: float) -> str:
    return f"{nbytes / GB:,.1f} GB"


# --- host --------------------------------------------------------------------------------------
def host_rows(out: Rows, facts: dict[str, Any], needs: Needs, clock_offset: tuple[float, float] | None) -> None:
    total, avail = num(facts, "host", "mem_total"), num(facts, "host", "mem_available")
    if total is None:
        out.add("host RAM", "not measured", "-", "warn", "the node has no /proc/meminfo: check its RAM by hand")
    elif needs.ram_gb is None:
        out.add("host RAM", _gb(total), "- (plan does not know the model)", "pass")
    else:
        status: Status = "fail" if total < needs.ram_gb * GB else "warn" if (avail or 0) < needs.ram_gb * GB else "pass"
        out.add(
            "host RAM",
            f"{_gb(total)} ({_gb(avail or 0)} available)",
            f">= {needs.ram_gb:.0f} GB (gpuctl plan)",
            status,
            ""
            if status == "pass"
            else "rent a host with that much RAM (offers filter on it), free the memory other "
            "processes hold, or shrink the need: `gpuctl plan` shows the closest config that fits",
        )
    shm = num(facts, "host", "shm", "total")
    where = get(facts, "host", "shm", "path") or "/dev/shm"
    if shm is None:
        out.add(
            "shared memory", f"{where}: not measured", f">= {MIN_SHM_GB:g} GB", "warn", f"check that {where} is mounted"
        )
    else:
        ok = shm >= MIN_SHM_GB * GB
        out.add(
            "shared memory",
            f"{where}: {shm / 2**20:,.0f} MB",
            f">= {MIN_SHM_GB:g} GB",
            "pass" if ok else "fail",
            ""
            if ok
            else f"NCCL and the data loader die with 'Bus error' on a small {where}: on the host "
            f"`mount -o remount,size=16G {where}`; in docker `--shm-size 16g` (docker.shm_size) or --ipc=host",
        )
    _disk_row(out, facts, needs)
    _cores_row(out, facts, needs)
    if clock_offset is not None:
        offset, spread = clock_offset
        status = "fail" if abs(offset) > CLOCK_FAIL_S else "warn" if abs(offset) > CLOCK_WARN_S else "pass"
        out.add(
            "clock offset",
            f"{offset:+.2f} s (± {spread:.2f})",
            f"within {CLOCK_WARN_S:g} s of this machine",
            status,
            ""
            if status == "pass"
            else "turn on time sync on the node (`timedatectl set-ntp true`, chrony); S3 "
            "refuses requests signed more than 15 minutes off",
        )


def _disk_row(out: Rows, facts: dict[str, Any], needs: Needs) -> None:
    free = num(facts, "host", "disk", "free")
    where = get(facts, "host", "disk", "path") or "?"
    if free is None:
        out.add("disk (checkpoints)", f"{where}: not measured", "-", "warn", "check the free space by hand")
        return
    if needs.disk_gb is None:
        out.add("disk (checkpoints)", f"{_gb(free)} free in {where}", "- (plan does not know the model)", "pass")
        return
    status: Status = "fail" if free < needs.disk_gb * GB else "pass"
    out.add(
        "disk (checkpoints)",
        f"{_gb(free)} free in {where}",
        f">= {needs.disk_gb:,.2f} GB (keep_local + 1 checkpoints, model download)",
        status,
        ""
        if status == "pass"
        else "free space there, put provider.workdir on a larger disk, rent more disk "
        "(provider.disk_gb) or keep fewer checkpoints on the node (train.keep_local)",
    )


def _cores_row(out: Rows, facts: dict[str, Any], needs: Needs) -> None:
    cores, cpus = num(facts, "host", "physical_cores"), num(facts, "host", "cpus")
    if cores is None:
        out.add("CPU cores", "not measured", "-", "warn", "check nproc on the node")
        return
    want = CORES_PER_RANK * needs.ranks if needs.offload else needs.ranks
    status: Status = "pass" if cores >= want else "warn"
    why = f"{CORES_PER_RANK} per rank for CPU Adam" if needs.offload else "one per rank"
    out.add(
        "CPU cores",
        f"{cores:.0f} physical ({cpus or cores:.0f} usable CPUs)",
        f">= {want} ({why})",
        status,
        ""
        if status == "pass"
        else "CPU Adam will bound the step time: pick an offer with more cores, or "
        "offload_optimizer: none if the GPUs can hold the optimizer (`gpuctl plan`)",
    )


# --- software, collective, storage ---------------------------------------------------------------
def software_rows(out: Rows, facts: dict[str, Any], needs: Needs) -> None:
    sw = get(facts, "software") or {}
    fix = "install it for provider.python (`pip install 'gpuctl[train]'`), or use the trainer image"
    for name in ("torch", "deepspeed"):
        version = get(sw, name)
        if isinstance(version, str):
            cuda = get(sw, "torch_cuda") if name == "torch" else None
            out.add(name, version + (f" (CUDA {cuda})" if isinstance(cuda, str) else ""), "importable", "pass")
        else:
            out.add(name, str(get(sw, f"{name}_error") or "not importable")[:200], "importable", "fail", fix)
            return
    if needs.quick:
        return
    adam = get(sw, "cpu_adam")
    if not needs.offload:
        out.na("CPU Adam op", "offload_optimizer: none")
    elif isinstance(adam, dict):
        secs = num(adam, "seconds") or 0.0
        ok = adam.get("ok") is True
        out.add(
            "CPU Adam op",
            f"loaded in {secs:.1f} s" if ok else str(adam.get("error"))[:200],
            "DeepSpeed builds and loads it",
            "pass" if ok else "fail",
            ""
            if ok
            else "the node needs a C++ compiler and the Python headers (the image prebuilds the op), and a "
            "writable TORCH_EXTENSIONS_DIR",
        )


def allreduce_rows(out: Rows, facts: dict[str, Any], needs: Needs, link_gbps: float | None) -> None:
    ar = get(facts, "allreduce")
    if needs.quick or not isinstance(ar, dict):
        return
    label = f"all-reduce ({ar.get('backend')}, {ar.get('ranks')} ranks, {(num(ar, 'bytes') or 0) / 2**20:.0f} MB)"
    if ar.get("skipped"):
        out.na(label, str(ar["skipped"]))
        return
    algbw, busbw = num(ar, "algbw"), num(ar, "busbw")
    if ar.get("error") or algbw is None or busbw is None or ar.get("sum_ok") is not True:
        why = ar.get("error") or "the reduced values are wrong"
        out.add(label, str(why)[:200], "completes", "fail", "ranks cannot talk: check NCCL_* env, the node's firewall")
        return
    value = f"algbw {algbw / GB:.2f} GB/s, busbw {busbw / GB:.2f} GB/s"
    if needs.accelerator != "cuda" or not link_gbps:
        out.add(label, value, "- (CPU ranks: no link to compare with)", "pass")
        return
    floor = link_gbps / 2
    ok = busbw / GB >= floor
    out.add(
        label,
        value,
        f"busbw >= {floor:.1f} GB/s (half the PCIe link)",
        "pass" if ok else "warn",
        "" if ok else "slower than the links allow: check the PCIe rows, NCCL_DEBUG=INFO in env, other load",
    )


def storage_rows(out: Rows, facts: dict[str, Any], needs: Needs) -> None:
    st = get(facts, "storage")
    if not needs.storage or not isinstance(st, dict):
        out.na("storage put/get/delete", "no storage configured")
        return
    url = st.get("url") or "storage.url"
    if st.get("error") or st.get("roundtrip") is not True or st.get("deleted") is not True:
        why = st.get("error") or "the object read back differs, or stayed after delete"
        out.add(
            "storage put/get/delete",
            f"{url}: {str(why)[:200]}",
            "ok with the run's credentials",
            "fail",
            "check storage.url and storage.endpoint_url, and that the credentials gpuctl hands the node "
            "(AWS_* / storage.profile) may put, get and delete there",
        )
        return
    out.add("storage put/get/delete", f"{url}: ok", "ok with the run's credentials", "pass")
    mb, put_s, get_s = num(st, "large_mb"), num(st, "put_s"), num(st, "get_s")
    if needs.quick or not (mb and put_s and get_s):
        return
    put_mbps, get_mbps = mb * 1.048576 / put_s, mb * 1.048576 / get_s
    ok = min(put_mbps, get_mbps) >= MIN_STORE_MBPS and st.get("large_ok") is True
    out.add(
        f"storage throughput ({mb:.0f} MB)",
        f"put {put_mbps:,.0f} MB/s, get {get_mbps:,.0f} MB/s",
        f">= {MIN_STORE_MBPS:g} MB/s",
        "pass" if ok else "warn",
        "" if ok else "checkpoint uploads will lag the run: a store nearer the node (region, endpoint_url)",
    )


def judge(
    node: str, facts: dict[str, Any], needs: Needs, clock_offset: tuple[float, float] | None = None
) -> list[CheckRow]:
    """Every row for one node, in the table's order."""
    from provision.estimate.doctor_gpu import gpu_rows, slowest_link
    from provision.estimate.doctor_speed import speed_rows

    out = Rows(node)
    host_rows(out, facts, needs, clock_offset)
    gpu_rows(out, facts, needs)
    software_rows(out, facts, needs)
    allreduce_rows(out, facts, needs, slowest_link(facts))
    storage_rows(out, facts, needs)
    speed_rows(out, facts, needs)
    return out.rows

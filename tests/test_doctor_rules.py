"""`gpuctl doctor`'s parsing and judgement, on real nvidia-smi outputs (tests/data/nvidia_smi/README.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from provision.estimate import nvsmi
from provision.estimate.doctor import judge
from provision.estimate.doctor_rows import Needs

DATA = Path(__file__).parent / "data" / "nvidia_smi"
RTX40_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"}


def read(name: str) -> str:
    return (DATA / name).read_text()


def test_rtx_4090_query_model_driver_and_a_gen3_slot():
    report = nvsmi.parse_query(read("rtx-4090-driver-535.xml"))
    assert (report.driver, report.cuda, report.attached, len(report.gpus)) == ("535.86.05", "12.2", 1, 1)
    gpu = report.gpus[0]
    assert gpu.name == "NVIDIA GeForce RTX 4090" and gpu.bus_id == "00000000:84:00.0"
    # the card does Gen4, the host slot Gen3: the link runs at Gen3 x16
    assert (gpu.link_gen, gpu.device_gen, gpu.host_gen, gpu.link_width, gpu.max_width) == (3, 4, 3, 16, 16)
    assert gpu.link_gbps == pytest.approx(0.985 * 16)
    assert gpu.ecc_enabled is False and gpu.uncorrectable_errors == 0


def test_a100_query_has_ecc_and_a_gen4_link():
    report = nvsmi.parse_query(read("a100-sxm4-v12.xml"))
    assert (report.driver, report.cuda, report.attached) == ("535.54.03", "12.2", 4)
    assert [g.name for g in report.gpus] == ["NVIDIA A100-SXM4-80GB"]  # the capture kept one of the four
    gpu = report.gpus[0]
    assert (gpu.link_gen, gpu.link_width, gpu.ecc_enabled, gpu.uncorrectable_errors) == (4, 16, True, 0)


def test_topology_of_an_8x_4090_server_is_all_sys():
    links = nvsmi.parse_topology(read("topo-8x-rtx-4090.txt"))
    assert len(links) == 8 * 7 // 2 and set(links.values()) == {"SYS"}
    assert nvsmi.worst_link(links) == "SYS"


def test_topology_of_a_mixed_rig_reads_each_pair():
    links = nvsmi.parse_topology(read("topo-5x-rtx-4090-club3090.txt"))
    assert len(links) == 10
    assert links[(1, 2)] == links[(3, 4)] == "PHB" and links[(1, 3)] == "NODE" and links[(0, 4)] == "SYS"
    assert nvsmi.worst_link({k: v for k, v in links.items() if 0 not in k}) == "NODE"


@pytest.mark.parametrize(
    "text, says",
    [
        ('<?xml version="1.0"?><!DOCTYPE x [<!ENTITY a "aaaa">]><nvidia_smi_log>&a;</nvidia_smi_log>', "entities"),
        ("<nvidia_smi_log><gpu>", "does not parse"),
        ("<html><body/></html>", "not nvidia_smi_log"),
        ("<nvidia_smi_log>" + " " * (nvsmi.MAX_XML_BYTES + 1) + "</nvidia_smi_log>", "larger than"),
    ],
)
def test_what_is_not_nvidia_smi_xml_is_refused(text, says):
    with pytest.raises(nvsmi.SmiParseError, match=says):
        nvsmi.parse_query(text)


def test_a_topology_cell_that_is_no_link_is_refused():
    with pytest.raises(nvsmi.SmiParseError, match="no topology link"):
        nvsmi.parse_topology("\tGPU0\tGPU1\nGPU0\t X \tFOO\nGPU1\tFOO\t X \n")


def gpu_facts(query: str, topo: str | None = None, torch_cuda: str | None = "12.8") -> dict:
    facts = {
        "host": {"mem_total": 256e9, "mem_available": 250e9, "shm": {"total": 64e9, "path": "/dev/shm"}},
        "gpu": {"present": True, "query": {"text": query}},
        "software": {"torch": "2.10.0", "deepspeed": "0.19.8", "torch_cuda": torch_cuda},
    }
    if topo is not None:
        facts["gpu"]["topo"] = {"text": topo}
    return facts


def rows_of(facts: dict, **needs) -> dict[str, list]:
    out: dict[str, list] = {}
    for row in judge("node0", facts, Needs(**{"ranks": 1, "accelerator": "cuda", **needs})):
        out.setdefault(row.check, []).append(row)
    return out


def test_the_4090_in_a_gen3_slot_warns_and_an_old_driver_fails():
    rows = rows_of(gpu_facts(read("rtx-4090-driver-535.xml")), gpu="RTX 4090")
    link = rows["PCIe link"][0]
    assert link.status == "warn" and "card Gen4, slot Gen3" in link.value and link.expected == "Gen4 x16"
    driver = rows["driver / CUDA"][0]  # driver 535 speaks CUDA 12.2; the image's torch is built for 12.8
    assert driver.status == "fail" and "12.2" in driver.value and "12.8" in driver.expected and driver.fix
    assert rows["GPUs"][0].status == "pass" and rows["ECC errors"][0].status == "n/a"
    assert rows["P2P topology"][0].status == "n/a"  # one GPU


def test_fewer_gpus_than_ranks_or_another_model_fails():
    facts = gpu_facts(read("rtx-4090-driver-535.xml"), torch_cuda="12.1")
    assert rows_of(facts, ranks=3)["GPUs"][0].status == "fail"
    assert rows_of(facts, gpu="A100")["GPUs"][0].status == "fail"
    assert rows_of(facts, gpu="RTX 4090")["driver / CUDA"][0].status == "pass"


def test_rtx40_p2p_needs_nccl_p2p_off():
    """The 8 x 4090 topology: P2P is disabled by the driver, so NCCL must be told."""
    xml = read("rtx-4090-driver-535.xml")
    two = xml.replace("</nvidia_smi_log>", "") + xml[xml.index("<gpu ") : xml.index("</nvidia_smi_log>")]
    facts = gpu_facts(two + "</nvidia_smi_log>", topo=read("topo-8x-rtx-4090.txt"))
    ok = rows_of(facts, ranks=2, rank_env=RTX40_ENV)["P2P topology"][0]
    assert ok.status == "pass" and "worst pair SYS" in ok.value
    bad = rows_of(facts, ranks=2, rank_env={"NCCL_P2P_DISABLE": "0"})["P2P topology"][0]
    assert bad.status == "fail" and "NCCL_P2P_DISABLE" in bad.fix


def test_cpu_nodes_mark_every_gpu_check_na():
    facts = {"host": {"mem_total": 32e9}, "gpu": {"present": False}, "software": {"torch": "2.13.0"}}
    rows = judge("n", facts, Needs(ranks=3, accelerator="cpu", runtime="docker"))
    gpu = {
        r.check: r.status
        for r in rows
        if r.check
        in ("GPUs", "driver / CUDA", "ECC errors", "Xid errors", "PCIe link", "P2P topology", "docker --gpus all")
    }
    assert gpu == dict.fromkeys(gpu, "n/a") and len(gpu) == 7


def test_host_rules_ram_shm_disk_clock():
    facts = {
        "host": {
            "mem_total": 128e9,
            "mem_available": 120e9,
            "shm": {"total": 64 * 2**20, "path": "/dev/shm"},
            "disk": {"free": 50e9, "path": "/root/gpuctl"},
            "physical_cores": 16,
            "cpus": 32,
        }
    }
    rows = {
        r.check: r
        for r in judge(
            "n", facts, Needs(ranks=3, accelerator="cpu", ram_gb=154, disk_gb=325, offload=True), (400.0, 0.1)
        )
    }
    assert rows["host RAM"].status == "fail" and "154" in rows["host RAM"].expected
    assert (
        rows["shared memory"].status == "fail"
        and "64 MB" in rows["shared memory"].value
        and "shm-size" in rows["shared memory"].fix
    )
    assert rows["disk (checkpoints)"].status == "fail" and "keep_local" in rows["disk (checkpoints)"].fix
    assert rows["CPU cores"].status == "pass"
    assert rows["clock offset"].status == "fail" and "+400" in rows["clock offset"].value


def eight(xml: str) -> str:
    """An 8-GPU report made of the capture's one <gpu> (the A100 capture kept one of its four)."""
    gpu = xml[xml.index("<gpu ") : xml.index("</nvidia_smi_log>")]
    return xml.replace("</nvidia_smi_log>", "") + gpu * 7 + "</nvidia_smi_log>"


def test_h100_topology_is_nvlink_everywhere_and_nccl_p2p_must_stay_on():
    links = nvsmi.parse_topology(read("topo-8x-h100-sxm-nv18.txt"))
    assert len(links) == 28 and set(links.values()) == {"NV18"}
    assert nvsmi.worst_link(links) == "NV18" and nvsmi.path_kind("NV18") == "NVLink"
    facts = gpu_facts(eight(read("a100-sxm4-v12.xml")), topo=read("topo-8x-h100-sxm-nv18.txt"))
    ok = rows_of(facts, ranks=8)["P2P topology"][0]
    assert ok.status == "pass" and ok.value == "worst pair NV18 (NVLink); 28 of 28 pairs over NVLink"
    off = rows_of(facts, ranks=8, rank_env={"NCCL_P2P_DISABLE": "1"})["P2P topology"][0]
    assert off.status == "warn" and "turns these NVLinks off" in off.fix

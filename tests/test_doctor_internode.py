"""`gpuctl doctor` across nodes: the all-reduce over every rank of two SSH nodes (127.0.0.1 and
127.0.0.2, CPU ranks over gloo), and the rule that holds its bus bandwidth against the nodes' link."""

from __future__ import annotations

import json

import pytest

from provision.estimate.doctor_net import internode_row
from tests.helpers import Gpuctl
from tests.test_doctor import rows_by_check, ssh_provider, write

GB = 1e9


def node_facts(busbw_gbs: float, speed_mbps: int | None, iface: str = "eth0") -> dict:
    algbw = busbw_gbs * GB * 4 / (2 * 3)  # 4 ranks: busbw = algbw x 2(n-1)/n
    allreduce = {
        "backend": "nccl",
        "ranks": 4,
        "bytes": 32 << 20,
        "sum_ok": True,
        "algbw": algbw,
        "busbw": busbw_gbs * GB,
    }
    return {"allreduce": allreduce, "link": {"iface": iface, "speed_mbps": speed_mbps}}


def test_busbw_is_held_against_the_slowest_nodes_link():
    hosts = ["a", "b"]
    fast = internode_row(hosts, [node_facts(9.0, 100_000), node_facts(9.0, 25_000)], "cuda")
    assert fast.status == "pass" and fast.expected.startswith("busbw >= 1.56 GB/s (half the 3.12 GB/s link")
    assert fast.check == "all-reduce across 2 nodes (nccl, 4 ranks, 32 MB)" and fast.node == "a, b"
    slow = internode_row(hosts, [node_facts(1.0, 100_000), node_facts(1.0, 100_000)], "cuda")
    assert slow.status == "warn" and "NCCL_SOCKET_IFNAME" in slow.fix and "busbw 1.00 GB/s" in slow.value
    unknown = internode_row(hosts, [node_facts(1.0, None, "lo"), node_facts(1.0, None, "lo")], "cuda")
    assert unknown.status == "pass" and unknown.expected == "- (link lo: the kernel reports no speed)"


def test_a_node_that_did_not_take_part_fails_the_row():
    broken = internode_row(["a", "b"], [node_facts(9.0, 100_000), "the checks script exited 1: timed out"], "cuda")
    assert broken.status == "fail" and broken.value == "b: the checks script exited 1: timed out"
    assert "GLOO_SOCKET_IFNAME" in broken.fix


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_ssh_nodes_all_reduce_across_every_rank(project, gpuctl: Gpuctl, sshd):
    provider = {**ssh_provider(sshd, project / "node"), "hosts": [sshd.host("127.0.0.1"), sshd.host("127.0.0.2")]}
    write(project, {**provider, "cpu_ranks": 2}, name="doc-two")
    gpuctl("up", check=True, timeout=300)
    doc = json.loads(gpuctl("doctor", "--json", check=True, timeout=900).stdout)
    row = rows_by_check(doc)["all-reduce across 2 nodes (gloo, 4 ranks, 32 MB)"]
    assert row["status"] == "pass" and row["node"] == "127.0.0.1, 127.0.0.2", row
    algbw, busbw = (float(part.split()[1]) for part in row["value"].split(", "))
    # nccl-tests: busbw = algbw x 2(n-1)/n, n = 4 ranks (the row prints GB/s to two decimals)
    assert algbw > 0 and busbw == pytest.approx(algbw * 2 * 3 / 4, abs=0.011)
    assert row["expected"] == "- (link lo: the kernel reports no speed)"  # loopback has no speed to hold it to
    assert {r["node"] for r in doc["rows"] if r["check"] == "shared memory"} == {"127.0.0.1", "127.0.0.2"}

    # the run's env names an interface the nodes do not have: the ranks cannot meet, and the row says what to set
    write(project, {**provider, "cpu_ranks": 2}, name="doc-two", env={"GLOO_SOCKET_IFNAME": "nosuch0"})
    bad = gpuctl("doctor", "--json", timeout=900)
    assert bad.returncode == 1, bad.stderr
    failed = rows_by_check(json.loads(bad.stdout))["all-reduce across 2 nodes (gloo, 4 ranks, 32 MB)"]
    assert failed["status"] == "fail" and "GLOO_SOCKET_IFNAME" in failed["fix"], failed
    gpuctl("down", "--yes", check=True)

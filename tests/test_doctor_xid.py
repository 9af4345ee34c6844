"""Xid events: parsed from real kernel-log lines (tests/data/kernel_log/README.md) and judged."""

from __future__ import annotations

from pathlib import Path

from provision.estimate import xid
from tests.test_doctor_rules import gpu_facts, read, rows_of

LOGS = Path(__file__).parent / "data" / "kernel_log"


def log(name: str) -> str:
    return (LOGS / name).read_text()


def with_xid(xid_facts: dict) -> dict:
    facts = gpu_facts(read("a100-sxm4-v12.xml"))
    facts["gpu"]["xid"] = xid_facts
    return facts


def test_dmesg_of_a_rented_node_finds_the_contained_ecc_error():
    events = xid.parse_log(log("dmesg-T-xid-43-31-94-akash.txt"))
    assert [(e.code, e.bus_id) for e in events] == [
        (43, "0000:00:05"),
        (43, "0000:00:05"),
        (31, "0000:00:07"),
        (94, "0000:00:08"),
    ]
    assert [e.code for e in events if e.critical] == [94]
    assert events[3].detail.startswith("pid='<unknown>', name=<unknown>, Contained: SM (0x1)")
    assert xid.summary(events).startswith("Xid 94 x1 (contained ECC error) on 0000:00:08; Xid 31 x1")


def test_journal_gpu_off_the_bus_fails_the_node_with_the_fix():
    lines = log("journal-k-xid-79-rtx5080.txt").splitlines()
    row = rows_of(with_xid({"source": "dmesg", "lines": lines}))["Xid errors"][0]
    assert row.status == "fail" and "Xid 79 x1 (GPU has fallen off the bus) on 0000:2b:00" in row.value
    assert row.fix.startswith("Xid 79: reboot the node")


def test_program_faults_only_warn_and_a_clean_log_passes():
    events = xid.parse_log(log("dmesg-xid-31-62-45-chia.txt"))
    assert [e.code for e in events] == [31, 62, 45, 45, 45] and not any(e.critical for e in events)
    warn = rows_of(with_xid({"source": "dmesg", "lines": log("dmesg-xid-31-62-45-chia.txt").splitlines()}))
    assert warn["Xid errors"][0].status == "warn" and "Xid 45 x3" in warn["Xid errors"][0].value
    clean = rows_of(with_xid({"source": "journalctl", "lines": []}))["Xid errors"][0]
    assert (clean.status, clean.value) == ("pass", "none since boot (journalctl)")


def test_a_node_without_a_readable_kernel_log_warns(monkeypatch, tmp_path):
    """No dmesg or journalctl on the PATH (a slim container): the node-side reader says so, the row warns."""
    from trainer.doctor import kernel_xids

    monkeypatch.setenv("PATH", str(tmp_path))
    facts = kernel_xids()
    assert facts == {"error": "dmesg: not installed; journalctl: not installed"}
    row = rows_of(with_xid(facts))["Xid errors"][0]
    assert row.status == "warn" and row.value.startswith("kernel log not readable: dmesg: not installed")
    assert "sudo dmesg" in row.fix

"""`gpuctl sweep` (issue 34, item 2): instances labelled as gpuctl's that no cluster record owns,
on every configured vendor account, listed with their $/h and terminated on request; everything
else -- a recorded cluster's instance, an instance gpuctl did not label, a cluster whose `up` or
`down` is running, a cluster whose record is damaged -- is left alone.

The fakes' instances are made directly in the fake (what a lost state dir leaves behind); the
records are written with core/state.py, as `up` writes them.
"""

from __future__ import annotations

import json

import pytest

from provision.core import state
from tests.fakes.harness import node_fields, write_config
from tests.fakes.runpod_api import FakeRunPod
from tests.fakes.vast_api import FakeVast

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def vendors(monkeypatch):
    """Vast.ai and RunPod accounts (their keys set), no AWS."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    with FakeVast() as vast, FakeRunPod() as runpod:
        monkeypatch.setenv("VAST_API_KEY", vast.key)
        monkeypatch.setenv("RUNPOD_API_KEY", runpod.key)
        yield vast, runpod


def vast_instance(fake: FakeVast, label: str, offer: int = 1001) -> int:
    status, answer = fake.handle("PUT", f"/api/v0/asks/{offer}/", {"image": "img", "label": label}, {})
    assert status == 200, answer
    return answer["new_contract"]


def pod(fake: FakeRunPod, name: str) -> str:
    arg = {
        "name": name,
        "imageName": "img",
        "gpuTypeId": "NVIDIA GeForce RTX 4090",
        "cloudType": "SECURE",
        "gpuCount": 3,
    }
    return fake._deploy(arg, spot=False)["id"]


def record(name: str, kind: str, api_url: str, instance_id: str, label: str, *, creating: bool = False) -> None:
    node = state.NodeRecord(host="node0", address="", instance_id=instance_id, label=label)
    state.save_cluster(state.ClusterRecord(name=name, provider=kind, nodes=[node], api_url=api_url, creating=creating))


def test_sweep_lists_only_what_no_record_owns_and_terminates_it(vendors, project, gpuctl, state_dir):
    vast, runpod = vendors
    write_config(project, {"kind": "vast", "api_url": vast.url}, name="mine")
    orphan = vast_instance(vast, "gpuctl-gone-0-abc123")  # its state dir was deleted
    mine = vast_instance(vast, "gpuctl-mine-0-def456", offer=1003)
    record("mine", "vast", vast.url, str(mine), "gpuctl-mine-0-def456")
    leaked = vast_instance(vast, "gpuctl-mine-0-0a0a0a", offer=1004)  # an earlier attempt of "mine", not in its record
    foreign = vast_instance(vast, "my-own-box", offer=1005)  # not gpuctl's: never listed
    busy = vast_instance(vast, "gpuctl-busy-0-111111", offer=1006)
    broken = vast_instance(vast, "gpuctl-broken-0-222222", offer=1007)
    (state_dir / "clusters" / "broken.json").write_text("{not json")
    rp_orphan = pod(runpod, "gpuctl-rp-gone-0-333333")
    rp_foreign = pod(runpod, "someone-elses-pod")
    rp_mine = pod(runpod, "gpuctl-rp-mine-0-444444")
    record("rp-mine", "runpod", runpod.url, rp_mine, "gpuctl-rp-mine-0-444444")  # it names RunPod's endpoint

    with state.cluster_lock("busy", "up"):  # an `up` of cluster busy is running
        listed = gpuctl("sweep", "--json")
        assert listed.returncode == 0, listed.stderr
        doc = json.loads(listed.stdout)
        strays = {(s["provider"], s["instance"]): s for s in doc["strays"]}
        assert set(strays) == {("vast", str(orphan)), ("vast", str(leaked)), ("runpod", rp_orphan)}
        assert strays[("vast", str(orphan))]["why"] == "no record"
        assert strays[("vast", str(orphan))]["cluster"] == "gone"
        assert strays[("vast", str(orphan))]["price_per_hour"] == 1.05  # the offer's dph_total
        assert strays[("vast", str(leaked))]["why"] == "not in cluster mine's record"
        assert strays[("runpod", rp_orphan)]["price_per_hour"] == pytest.approx(3 * 0.69)  # the pod's costPerHr
        assert doc["terminated"] == [] and not vast.deleted and not runpod.terminated  # --json alone: a list
        skipped = "\n".join(doc["skipped"])
        assert "cluster broken: its record is damaged" in skipped
        assert f"vast instance {busy}: an `up` or `down` of cluster busy is running" in skipped
        assert "aws: not configured here" in skipped

        declined = gpuctl("sweep", input="n\n")
        assert declined.returncode == 1 and "nothing terminated" in declined.stderr
        assert "terminate 3 instance(s) ($" in declined.stderr and str(orphan) in declined.stdout
        assert not vast.deleted

        done = gpuctl("sweep", "--yes")
        assert done.returncode == 0, done.stdout + done.stderr
        clean = gpuctl("sweep", "--yes", "--provider", "vast")
        assert clean.returncode == 0 and "no stray gpuctl instance on vast" in clean.stdout, clean.stdout
    assert sorted(vast.deleted) == sorted([orphan, leaked]) and runpod.terminated == [rp_orphan]
    assert sorted(vast.instances) == sorted([mine, foreign, busy, broken]) and sorted(runpod.pods) == sorted(
        [rp_foreign, rp_mine]
    )
    assert f"terminated vast instance(s) {orphan} of cluster gone; vast no longer lists them" in done.stderr
    assert [p.name for p in sorted((state_dir / "clusters").glob("*.json"))] == [
        "broken.json",
        "mine.json",
        "rp-mine.json",
    ]


def test_sweep_takes_an_interrupted_up_down(vendors, project, gpuctl, state_dir):
    """A record still `creating` (its `up` died): the instance it lists and the one under its label
    without an id go, and so does the record, as `gpuctl down` would do it."""
    vast, _runpod = vendors
    write_config(project, {"kind": "vast", "api_url": vast.url}, name="half")
    recorded = vast_instance(vast, "gpuctl-half-0-abcdef")
    lost_answer = vast_instance(vast, "gpuctl-half-1-abcdef", offer=1003)
    node0 = state.NodeRecord(host="node0", address="", instance_id=str(recorded), label="gpuctl-half-0-abcdef")
    node1 = state.NodeRecord(host="node1", address="", label="gpuctl-half-1-abcdef")
    state.save_cluster(
        state.ClusterRecord(name="half", provider="vast", nodes=[node0, node1], api_url=vast.url, creating=True)
    )
    listed = json.loads(gpuctl("sweep", "--json", "--provider", "vast").stdout)
    assert {(s["instance"], s["why"]) for s in listed["strays"]} == {
        (str(recorded), "interrupted `up`"),
        (str(lost_answer), "interrupted `up`"),
    }
    done = gpuctl("sweep", "--yes", "--provider", "vast")
    assert done.returncode == 0, done.stderr
    assert sorted(vast.deleted) == sorted([recorded, lost_answer]) and not vast.instances
    assert not list(state_dir.glob("clusters/*.json")) and "cluster half is down" in done.stderr


def test_sweep_with_no_account_and_a_bad_provider(project, gpuctl, monkeypatch, tmp_path):
    for name in ("VAST_API_KEY", "RUNPOD_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.vast_api_key, ~/.runpod, ~/.aws
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    write_config(project, {"kind": "vast", **node_fields(tmp_path)}, name="none")
    nothing = gpuctl("sweep")
    assert nothing.returncode == 0, nothing.stderr
    assert "vast: not configured here (no Vast.ai API key found" in nothing.stderr
    assert "no stray gpuctl instance on no account" in nothing.stdout
    bad = gpuctl("sweep", "--provider", "gcp")
    assert bad.returncode == 2 and "--provider gcp is not one of vast, runpod, aws" in bad.stderr
    assert "Traceback" not in bad.stderr

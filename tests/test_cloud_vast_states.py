"""Provider vast: states that never become ready, refusals that come as HTTP 200, the paged list.

Against the fake Vast.ai API (tests/fakes/vast_api.py) whose instances are the loopback sshd.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from provision.core.config import load_config
from provision.core.errors import ProviderError
from provision.core.state import ClusterRecord
from provision.providers import cloud, vast
from provision.providers.base import UpOptions
from tests.fakes.harness import node_fields, ssh_target, write_config
from tests.fakes.vast_api import FakeVast

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def fake(sshd, monkeypatch):
    with FakeVast(ssh=ssh_target(sshd)) as server:
        monkeypatch.setenv("VAST_API_KEY", server.key)
        monkeypatch.setattr(cloud, "POLL_S", 0.2)
        yield server


def up(project, fake, tmp_path, **extra):
    provider = {"kind": "vast", "api_url": fake.url, **node_fields(tmp_path), "ready_timeout": 600, **extra}
    write_config(project, provider, name="vast-s")
    from provision.flows import cluster

    said: list[str] = []
    return cluster.up(load_config(project / "gpuctl.yaml"), UpOptions(assume_yes=True, say=said.append)), said


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("actual_status", "exited", "exited"),
        ("actual_status", "offline", "offline"),
        ("actual_status", "unknown", "unknown"),
        ("intended_status", "stopped", "stopped"),
        ("cur_state", "stopped", "stopped"),
    ],
)
def test_a_state_that_never_runs_fails_fast_and_is_destroyed(
    project, fake, tmp_path, state_dir, monkeypatch, field, value, shown
):
    real_view = fake._view

    def view(inst, count=True):
        raw = real_view(inst, count)
        if inst["_reads"] > 1:
            raw[field] = value
        return raw

    monkeypatch.setattr(fake, "_view", view)
    started = time.monotonic()
    with pytest.raises(ProviderError) as err:
        up(project, fake, tmp_path)
    assert f"ended in state '{shown}" in err.value.one_line()
    assert time.monotonic() - started < 60  # not the 600 s ready_timeout
    assert not fake.instances and fake.deleted == [7000001]
    assert not list(state_dir.glob("clusters/*.json"))


def test_an_unschedulable_machine_is_an_error_at_create_not_a_stopped_instance(project, fake, tmp_path, state_dir):
    fake.unschedulable = {1001}  # cancel_unavail: Vast says so at once
    with pytest.raises(ProviderError) as err:
        up(project, fake, tmp_path)
    line = err.value.one_line()
    assert "PUT /api/v0/asks/1001/ (HTTP 400): Required resources unavailable" in line
    assert not fake.instances and not fake.deleted
    assert not list(state_dir.glob("clusters/*.json"))


def test_without_cancel_unavail_the_stopped_instance_is_caught(project, fake, tmp_path, monkeypatch):
    """What our old create did: the stopped instance shows its reason and is destroyed at once."""
    fake.unschedulable = {1001}
    real = vast.create_body
    monkeypatch.setattr(vast, "create_body", lambda *a: {k: v for k, v in real(*a).items() if k != "cancel_unavail"})
    started = time.monotonic()
    with pytest.raises(ProviderError) as err:
        up(project, fake, tmp_path)
    assert "ended in state 'stopped (Unable to schedule: required resources unavailable)'" in err.value.one_line()
    assert time.monotonic() - started < 60 and not fake.instances and fake.deleted == [7000001]


def test_a_delete_answered_success_false_is_an_error_not_silence(project, gpuctl, fake, tmp_path, state_dir):
    record, _ = up(project, fake, tmp_path)
    fake.refuse_delete = {7000001}
    result = gpuctl("down", "--yes")
    assert result.returncode == 5
    lines = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1
    assert "Vast.ai refused to destroy instance 7000001: Instance is locked by an ongoing operation" in lines[0]
    assert (state_dir / "clusters" / "vast-s.json").exists() and 7000001 in fake.instances  # still recorded
    assert [c.body for c in fake.calls if c.method == "DELETE"] == [{}]  # the client's body
    fake.refuse_delete = set()
    assert gpuctl("down", "--yes").returncode == 0 and not fake.instances


def test_the_node_teardown_does_not_take_success_false_for_done(project, fake, tmp_path, monkeypatch):
    record, _ = up(project, fake, tmp_path)
    fake.refuse_delete = {7000001}
    teardown = vast.BACKEND.self_teardown(record)
    script = teardown.argv[2].replace("time.sleep(min(60, 2 ** attempt))", "time.sleep(0)")  # no 10 minutes here
    done = subprocess.run(
        [teardown.argv[0], "-c", script, *teardown.argv[3:]],
        env={**os.environ, **teardown.env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "self-teardown retrying: Instance is locked" in done.stdout
    assert 7000001 in fake.instances


def test_list_pages_through_the_v1_list_as_the_client_does(fake):
    for _ in range(60):  # 60 instances of one offer, made behind gpuctl's back
        fake._create(1001, {"image": "x", "label": "bulk"})
        fake.offers[0]["rented"] = False
    record = ClusterRecord(name="c", provider="vast", nodes=[], api_url=fake.url)
    found = vast.BACKEND.list_instances(record)
    assert sorted(int(i.id) for i in found) == sorted(fake.instances)
    pages = [c for c in fake.calls if c.path == "/api/v1/instances/"]
    assert len(pages) == 3 and "after_token" not in pages[0].query and pages[2].query["after_token"]
    assert pages[0].query["limit"] == "25" and pages[0].query["select_filters"] == "{}"


def test_describe_asks_for_owner_me_and_an_api_v0_url_still_works(fake):
    fake._create(1001, {"image": "x", "label": "one"})
    old_style = ClusterRecord(name="c", provider="vast", nodes=[], api_url=f"{fake.origin}/api/v0")
    inst = vast.BACKEND.describe(old_style, "7000001")
    assert inst is not None and inst.label == "one"
    assert fake.calls[-1].path == "/api/v0/instances/7000001/" and fake.calls[-1].query == {"owner": "me"}
    assert vast.BACKEND.describe(old_style, "7999999") is None  # 404: gone

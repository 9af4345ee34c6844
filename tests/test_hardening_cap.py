"""The budget cap does not fail open (issue 34, item 7) against the fake vendor APIs, whose
instances are the loopback sshd (this machine):

- a price that is no price (nan, 0, negative) is refused before anything is rented;
- the guard's teardown is tried at `up`, from the node, with the key it got: a key the vendor
  refuses fails `up` at once and leaves nothing rented;
- every node keeps a guard of its own that deletes it at the cap (plus a slack), should node 0's
  guard be gone;
- a container restart starts the guards again with the same deadline: the vendor's start-up
  (Vast's onstart, the image's entrypoint on RunPod) runs the boot hook.
AWS (the `shutdown -h +N` backstop, a reboot) is in test_hardening_aws.py.
"""

from __future__ import annotations

import math
import os
import re
import signal
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from provision.core import state
from provision.core.config import load_config
from provision.core.errors import ProviderError
from provision.core.provider_config import RunPodProvider, VastProvider
from provision.flows import cluster, guard
from provision.providers import http, prices, runpod
from provision.providers.base import UpOptions
from tests.fakes.guards import kill_guards, restart_and_check
from tests.fakes.harness import node_fields, serve_runpod, serve_vast, wait_until, write_config
from tests.fakes.runpod_api import gpu_type
from tests.fakes.vast_api import offer
from tests.helpers import REPO

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def vast_fake(sshd, monkeypatch):
    yield from serve_vast(sshd, monkeypatch, addresses=("127.0.0.1", "127.0.0.2"))


@pytest.fixture
def runpod_fake(sshd, monkeypatch):
    yield from serve_runpod(sshd, monkeypatch)


@pytest.fixture(autouse=True)
def no_guard_left(project, tmp_path):
    """The stand-in node is this machine: a "deleted" node's guards are the test's to end."""
    yield
    kill_guards(tmp_path)


def configure(project: Path, fake, tmp_path: Path, kind: str, name: str, **prov) -> None:
    write_config(project, {"kind": kind, "api_url": fake.url, **node_fields(tmp_path), **prov}, name=name)


def up(project: Path, said: list[str] | None = None) -> state.ClusterRecord:
    cfg = load_config(project / "gpuctl.yaml")
    record = cluster.up(cfg, UpOptions(assume_yes=True, say=(said if said is not None else []).append))
    assert record is not None
    return record


# --- a price that is no price -------------------------------------------------------------------


@pytest.mark.parametrize("price", [math.nan, 0, -1], ids=["nan", "zero", "negative"])
def test_a_vendor_price_that_is_no_price_refuses_up_and_rents_nothing(project, gpuctl, vast_fake, tmp_path, price):
    vast_fake.offers = [offer(1001, price=price), offer(1003, price=1.45)]
    configure(project, vast_fake, tmp_path, "vast", "cap-nan", max_cost=10)
    result = gpuctl("up", "--yes")
    assert result.returncode == 5, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Vast.ai offer 1001: dph_total is" in errors[0] and "not a price" in errors[0]
    assert "fix:" in errors[0] and "Traceback" not in result.stderr and "no budget cap" not in result.stderr
    assert not vast_fake.created_bodies and not vast_fake.instances  # nothing rented


def test_runpod_price_fields_are_checked(runpod_fake):
    """A GraphQL Float cannot be nan (the server refuses to send it); a negative one can."""
    runpod_fake.gpu_types = [gpu_type(secure=-1.0, community=-1.0)]
    with pytest.raises(ProviderError, match="RunPod's uninterruptablePrice of 'NVIDIA GeForce RTX 4090'"):
        runpod.BACKEND.find_offers(RunPodProvider(api_url=runpod_fake.url))
    runpod_fake.gpu_types = [gpu_type(secure=0, community=0)]  # 0 (as null): none offered
    assert runpod.BACKEND.find_offers(RunPodProvider(api_url=runpod_fake.url)) == []


@given(st.one_of(st.floats(), st.integers(), st.text(max_size=5), st.booleans(), st.none()))
def test_a_vendor_price_is_a_finite_number_above_zero(value):
    good = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if good:
        assert prices.vendor_price(value, "x") == float(value)
    else:
        with pytest.raises(ProviderError, match="x is .* not a price in \\$/h"):
            prices.vendor_price(value, "x")


@pytest.mark.parametrize("price", [math.nan, 0.0, -1.0, math.inf])
def test_a_cost_cap_that_cannot_come_is_an_error_not_no_cap(price):
    with pytest.raises(ProviderError, match="provider.max_cost cannot be enforced"):
        prices.budget_hours(VastProvider(max_cost=10), price, spent_hours=0, spent_cost=0)
    assert prices.budget_hours(VastProvider(max_hours=2), price, spent_hours=0.5, spent_cost=0) == 1.5


# --- the guard's teardown tried at `up` ---------------------------------------------------------


@pytest.mark.parametrize("kind", ["vast", "runpod"])
def test_a_key_the_vendor_refuses_for_the_guard_fails_up_at_once(project, request, tmp_path, monkeypatch, kind):
    """The node gets a key the vendor refuses (revoked, or scoped without instance access): the
    guard's dry run on the node says so at `up`, not hours later at the cap; nothing is left."""
    fake = request.getfixturevalue(f"{kind}_fake")
    configure(project, fake, tmp_path, kind, "cap-key", max_hours=1)
    monkeypatch.setattr(http.JsonApi, "secret", lambda self: "revoked-key-0123456789")
    started = time.monotonic()
    with pytest.raises(ProviderError) as err:
        up(project)
    line = err.value.one_line()
    assert "the budget guard on" in line and f"could not reach {kind} with its key" in line and "HTTP 401" in line
    assert "revoked-key" not in line and fake.key not in line
    assert time.monotonic() - started < 60  # at once, not after the teardown's ten minutes of retries
    assert not (fake.instances if kind == "vast" else fake.pods)  # terminated
    assert state.find_cluster("cap-key") is None
    assert not list((tmp_path / "node" / "guard").glob("*.pid"))  # no guard was started


def test_the_guards_dry_run_passes_with_a_good_key(project, vast_fake, tmp_path):
    configure(project, vast_fake, tmp_path, "vast", "cap-ok", max_hours=1)
    record = up(project)
    gets = [c for c in vast_fake.calls if c.method == "GET" and c.path == "/api/v0/instances/7000001/"]
    assert any(c.headers.get("user-agent", "").startswith("Python-urllib") for c in gets)  # from the node
    assert vast_fake.instances and not vast_fake.deleted
    cluster.down(record.name, say=lambda _: None)


# --- every node deletes itself at the cap ------------------------------------------------------


def test_every_node_deletes_itself_at_the_cap_when_node_0s_guard_is_gone(project, vast_fake, tmp_path, monkeypatch):
    monkeypatch.setattr(guard, "BACKSTOP_SLACK_MIN", 0.1)  # node 1's own guard: 6 s after the cap
    vast_fake.offers.append(offer(1019, price=1.60))
    prov = {"kind": "vast", "api_url": vast_fake.url, "nodes": 2, "max_hours": 0.01, **node_fields(tmp_path, ranks=1)}
    write_config(project, prov, name="cap-two", micro_batch=1, grad_accum=2)
    record = up(project)
    folder = tmp_path / "node" / "guard"  # the two stand-in nodes share this machine's disk
    node0 = int((folder / "guard.pid").read_text())
    os.killpg(node0, signal.SIGKILL)  # node 0's guard is gone (killed, its node wedged)
    backstop = (folder / "backstop1.sh").read_text()
    assert "/api/v0/instances/7000002/" in backstop and "/api/v0/instances/7000001/" not in backstop
    deadline = int(re.search(r"^DEADLINE=(\d+)$", (folder / "guard.sh").read_text(), re.M)[1])
    assert int(re.search(r"^DEADLINE=(\d+)$", backstop, re.M)[1]) == pytest.approx(deadline + 6, abs=2)
    wait_until(lambda: 7000002 not in vast_fake.instances, 120, "node 1 to delete itself", every=0.5)
    assert time.time() >= record.created_at + 0.01 * 3600  # not before the cap
    assert vast_fake.deleted == [7000002] and 7000001 in vast_fake.instances  # itself, and only itself
    cluster.down(record.name, say=lambda _: None)


# --- a container restart starts the guard again, same deadline ----------------------------------


def test_vast_onstart_starts_the_guard_again_with_the_same_deadline(project, vast_fake, tmp_path):
    configure(project, vast_fake, tmp_path, "vast", "cap-vast", max_hours=1)
    record = up(project)
    body = vast_fake.created_bodies[0]
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path / "home"), **body["env"]}
    # Vast runs onstart at every container start with the instance's env. Its /etc/environment
    # rewrite must not touch this machine's: a private mount puts a stand-in file there, which
    # the rewrite's final mv cannot replace (a mount point); the rest of onstart runs on.
    stand_in = tmp_path / "environment"
    stand_in.write_text("")
    script = 'mount --bind "$1" /etc/environment && exec bash -c "$2"'
    boot = ["unshare", "-m", "bash", "-c", script, "onstart", str(stand_in), body["onstart"]]
    restart_and_check(tmp_path / "node" / "guard", boot, env)
    cluster.down(record.name, say=lambda _: None)


def test_runpod_entrypoint_starts_the_guard_again_with_the_same_deadline(project, runpod_fake, tmp_path):
    configure(project, runpod_fake, tmp_path, "runpod", "cap-rp", max_hours=1)
    record = up(project)
    pod_env = {e["key"]: e["value"] for e in runpod_fake.deploy_inputs[0]["env"]}
    assert pod_env["GPUCTL_WORKDIR"] == str(tmp_path / "node")
    # RunPod starts the pod's container again with the image's entrypoint and the pod's env; the
    # sshd it would start is the test's own here (GPUCTL_SSHD=0).
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path / "home"), **pod_env, "GPUCTL_SSHD": "0"}
    boot = ["bash", str(REPO / "images" / "entrypoint.sh"), "true"]
    restart_and_check(tmp_path / "node" / "guard", boot, env)
    cluster.down(record.name, say=lambda _: None)


def test_the_vendors_start_up_runs_the_one_boot_hook():
    from provision.providers import vast
    from provision.providers.base import BOOT_HOOK

    assert vast.ONSTART.rstrip().endswith(BOOT_HOOK)
    assert f"( {BOOT_HOOK} )" in (REPO / "images" / "entrypoint.sh").read_text()

"""A killed `gpuctl up` leaves nothing billing (issue 34, item 2).

`gpuctl up` runs as a subprocess against the fake Vast.ai and RunPod APIs, whose instance answers
SSH through a TcpProxy to the loopback sshd. A hook sends a signal at one step -- right after the
vendor created the instance but before its answer reaches gpuctl, right after the answer (at the
next vendor request), and while gpuctl waits for SSH -- and holds that step until gpuctl is gone,
so every point is hit by construction. SIGTERM and SIGHUP are answered as Ctrl-C is (the abort
terminates what the attempt created); after SIGKILL, `gpuctl status` still knows the cluster and
`gpuctl down` or `gpuctl sweep --yes` leaves the vendor's instance list empty.
"""

from __future__ import annotations

import json
import re
import signal
import threading

import pytest
import yaml

from provision.providers import cloud
from tests.fakes.base import SshTarget
from tests.fakes.harness import Killer, node_fields, write_config
from tests.fakes.runpod_api import FakeRunPod
from tests.fakes.tcp_proxy import TcpProxy
from tests.fakes.vast_api import FakeVast

pytestmark = pytest.mark.timeout(240)


def vast_fake(target: SshTarget, monkeypatch) -> FakeVast:
    fake = FakeVast(ssh=target)
    real_view = fake._view

    def booted(inst: dict, count: bool = True) -> dict:  # running at the first poll: the kill is the point
        inst["_reads"] = max(inst["_reads"], fake.boot_polls)
        return real_view(inst, count)

    monkeypatch.setattr(fake, "_view", booted)
    return fake


VENDORS = {
    # kind: (make the fake, its key variable, is this request the create?, what it still bills)
    "vast": (vast_fake, "VAST_API_KEY", lambda m, p, _b: m == "PUT" and "/asks/" in p, lambda f: list(f.instances)),
    "runpod": (
        lambda target, _mp: FakeRunPod(ssh=target, boot_polls=0),
        "RUNPOD_API_KEY",
        lambda _m, _p, b: isinstance(b, dict) and "podFindAndDeployOnDemand" in str(b.get("query")),
        lambda f: list(f.pods),
    ),
}


@pytest.fixture
def vendor(request, sshd, project, tmp_path, monkeypatch):
    """(kind, fake, proxy): the fake of request.param serving, gpuctl.yaml pointing at it."""
    kind = request.param
    make, key_env, _is_create, _live = VENDORS[kind]
    for other in ("VAST_API_KEY", "RUNPOD_API_KEY", "AWS_ACCESS_KEY_ID", "AWS_PROFILE"):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # sweep asks boto3 for AWS credentials: no IMDS probe
    with TcpProxy(("127.0.0.1", sshd.port)) as proxy:
        target = SshTarget("127.0.0.1", proxy.port, sshd.authorized_keys, sshd.user)
        with make(target, monkeypatch) as fake:
            monkeypatch.setenv(key_env, fake.key)
            monkeypatch.setattr(cloud, "POLL_S", 0.2)
            write_config(project, {"kind": kind, "api_url": fake.url, **node_fields(tmp_path)}, name=f"{kind}-k")
            yield kind, fake, proxy


def arm(point: str, kind: str, fake, proxy: TcpProxy, killer: Killer) -> None:
    """Fire the killer at `point` of the `up` under test."""
    is_create = VENDORS[kind][2]
    created = threading.Event()

    def on_answer(method: str, path: str, body) -> None:
        if is_create(method, path, body):
            created.set()
            if point == "create done, answer lost":
                killer.fire()

    def on_request(_method: str, _path: str) -> None:
        if point == "create answered" and created.is_set():
            killer.fire()  # the first request after the create's answer: gpuctl read it

    def on_chunk(_conn: int, _direction: str, _data: bytes) -> None:
        if point == "waiting for SSH":
            killer.fire()

    fake.on_answer, fake.on_request, proxy.on_chunk = on_answer, on_request, on_chunk


def disarm(fake, proxy: TcpProxy) -> None:
    fake.on_answer = fake.on_request = proxy.on_chunk = None


POINTS = ["create done, answer lost", "create answered", "waiting for SSH"]
CASES = [(kind, point, "KILL", finish) for kind in VENDORS for point in POINTS for finish in ("down", "sweep")]
CASES += [(kind, point, sig, "") for kind in VENDORS for point in POINTS[0::2] for sig in ("TERM", "HUP")]


@pytest.mark.parametrize(
    "vendor,point,sig,finish",
    CASES,
    ids=[f"{k}-{p.split(',')[0].replace(' ', '_')}-{s}-{f}".rstrip("-") for k, p, s, f in CASES],
    indirect=["vendor"],
)
def test_a_killed_up_leaves_nothing_billing(vendor, point, sig, finish, project, state_dir, gpuctl):
    kind, fake, proxy = vendor
    live = VENDORS[kind][3]
    killer = Killer(getattr(signal, f"SIG{sig}"))
    arm(point, kind, fake, proxy, killer)
    rc, err = killer.run(project, "up", "--yes")
    disarm(fake, proxy)
    assert "Traceback" not in err, err[-3000:]
    if sig == "KILL":
        assert rc == -signal.SIGKILL and live(fake), err[-3000:]  # it bills, and gpuctl is gone
        status = gpuctl("status")
        assert f"cluster {kind}-k" in status.stdout and "not up yet" in status.stdout, status.stdout + status.stderr
        done = gpuctl(finish, "--yes")
        assert done.returncode == 0, done.stdout + done.stderr
    else:  # answered as Ctrl-C: the abort terminated what the attempt created
        assert rc == 130, err[-3000:]
        assert "interrupted: terminating the 1 instance(s) this attempt created" in err, err[-3000:]
    assert live(fake) == []
    assert not list(state_dir.glob("clusters/*.json"))
    again = gpuctl("down", "--yes")
    assert again.returncode == 0 and "nothing to do" in again.stderr


@pytest.mark.parametrize("vendor", ["vast"], indirect=True)
def test_the_next_up_replaces_what_a_killed_up_left(vendor, project, state_dir, gpuctl):
    """`up` after a SIGKILL'd `up` (its record still `creating`, no `up` running): it terminates
    what the killed one created, then creates the cluster anew."""
    kind, fake, proxy = vendor
    killer = Killer(signal.SIGKILL)
    arm("create done, answer lost", kind, fake, proxy, killer)
    killer.run(project, "up", "--yes")
    disarm(fake, proxy)
    (first,) = fake.instances
    train = gpuctl("train")
    assert train.returncode == 1 and "cluster vast-k is not up: an `up` is creating it or was stopped" in train.stderr
    up = gpuctl("up", "--yes", "--skip-doctor")
    assert up.returncode == 0, up.stderr[-3000:]
    assert "an earlier `up` of cluster vast-k was stopped before it finished: removing what it created" in up.stderr
    assert first in fake.deleted and len(fake.instances) == 1
    record = json.loads((state_dir / "clusters" / "vast-k.json").read_text())
    assert not record["creating"] and record["nodes"][0]["instance_id"] == str(next(iter(fake.instances)))
    assert re.fullmatch(r"gpuctl-vast-k-0-[0-9a-f]{6}", record["nodes"][0]["label"])
    assert gpuctl("down", "--yes").returncode == 0 and not fake.instances


@pytest.mark.parametrize("vendor", ["vast"], indirect=True)
def test_sigterm_while_shipping_leaves_no_secrets_env(vendor, project, state_dir, monkeypatch):
    """`gpuctl train` stopped by SIGTERM while the bundle goes to the node: the run's secrets.env
    (the `secrets:` values, 0600 in the state dir until shipped) is removed as after a Ctrl-C."""
    from provision.core.config import load_config
    from provision.flows import cluster
    from provision.providers.base import UpOptions

    kind, fake, proxy = vendor
    cfg_path = project / "gpuctl.yaml"
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["secrets"] = ["MY_TEST_TOKEN"]
    cfg_path.write_text(yaml.safe_dump(cfg))
    monkeypatch.setenv("MY_TEST_TOKEN", "tok-0123456789")
    cluster.up(load_config(cfg_path), UpOptions(assume_yes=True, say=lambda _line: None, doctor=False))
    killer = Killer(signal.SIGTERM)
    # the bundle on its way (a big chunk: the handshake that train starts early sends small ones)
    proxy.on_chunk = lambda _c, _d, data: killer.fire() if len(data) > 16384 else None
    rc, err = killer.run(project, "train")
    proxy.on_chunk = None
    assert rc == 130 and "shipping the run bundle" in err, err[-3000:]
    # rendered, then stopped on its way (under load the signal may land once the start is under way: then
    # train records the run before it stops, and runs/ holds its record beside the bundle)
    (bundle,) = [p for p in (state_dir / "runs").iterdir() if p.is_dir()]
    assert (bundle / "run.json").is_file() and not (bundle / "secrets.env").exists()
    assert not [p for p in state_dir.rglob("*") if p.is_file() and b"tok-0123456789" in p.read_bytes()]

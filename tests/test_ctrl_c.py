"""Ctrl-C while gpuctl holds paid resources (issue 20): answered within seconds, nothing left.

`gpuctl up` runs as a subprocess against a fake Vast.ai whose instance answers SSH through a
TcpProxy; the fake's request hook and the proxy's chunk hook press Ctrl-C (SIGINT) at a given
vendor request or SSH step -- and hold that step, as a hung vendor or network would -- so every
point is hit by construction, not by timing. Each case asserts exit 130 within EXIT_WITHIN_S of
the press, the fake's instance list empty and no cluster left in the state dir.
The abort's own bounds (a second Ctrl-C, a vendor slower than ABORT_S) and the root cause (a
press that a finalizer swallowed) are checked too.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from provision.core import interrupt
from provision.core.config import load_config
from provision.core.errors import ProviderError
from provision.providers import abort, cloud
from provision.providers.base import UpOptions
from provision.transport.ssh import channel
from tests.fakes.base import SshTarget
from tests.fakes.harness import node_fields, wait_until, write_config
from tests.fakes.tcp_proxy import TcpProxy
from tests.fakes.vast_api import FakeVast
from tests.helpers import GPUCTL

pytestmark = pytest.mark.timeout(180)
EXIT_WITHIN_S = 10.0  # from the press to the process gone, on a loaded 2-core machine


class CtrlC:
    """Presses Ctrl-C once on the gpuctl under test when a hook says so; `hold` then blocks that
    hook (the vendor request or SSH step stalls) until the test ends."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.pressed_at: float | None = None
        self.release = threading.Event()

    def press(self, hold: bool = False) -> None:
        if self.pressed_at is not None or self.proc is None:
            return
        self.pressed_at = time.monotonic()
        self.proc.send_signal(signal.SIGINT)
        if hold:
            self.release.wait(60)

    def up(self, project) -> tuple[int, str, float]:
        """`gpuctl up --yes`; (exit code, stderr, seconds from the press to the exit)."""
        self.proc = subprocess.Popen(
            [*GPUCTL, "up", "--yes"], cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            _out, err = self.proc.communicate(timeout=90)
            ended = time.monotonic()
        finally:
            self.release.set()
            if self.proc.poll() is None:
                self.proc.kill()
        assert self.pressed_at is not None, f"the step was never reached: {err[-2000:]}"
        return self.proc.returncode, err, ended - self.pressed_at


@pytest.fixture
def ctrl_c():
    presser = CtrlC()
    yield presser
    presser.release.set()


@pytest.fixture
def cloud_up(sshd, project, tmp_path, monkeypatch):
    """A fake Vast.ai whose instance runs at its first poll, reached over SSH through a proxy."""
    with TcpProxy(("127.0.0.1", sshd.port)) as proxy:
        target = SshTarget("127.0.0.1", proxy.port, sshd.authorized_keys, sshd.user)
        with FakeVast(ssh=target) as fake:
            real_view = fake._view

            def booted(inst: dict, count: bool = True) -> dict:
                inst["_reads"] = max(inst["_reads"], fake.boot_polls)
                return real_view(inst, count)

            monkeypatch.setattr(fake, "_view", booted)
            monkeypatch.setenv("VAST_API_KEY", fake.key)
            monkeypatch.setattr(cloud, "POLL_S", 0.2)
            monkeypatch.setattr(abort, "POLL_S", 0.2)
            write_config(project, {"kind": "vast", "api_url": fake.url, **node_fields(tmp_path)}, name="vast-t")
            yield fake, proxy


def assert_left_nothing(fake: FakeVast, state_dir, rc: int, err: str, took: float) -> None:
    assert rc == 130, err[-3000:]
    assert took < EXIT_WITHIN_S, f"exited {took:.1f}s after the Ctrl-C: {err[-3000:]}"
    assert not fake.instances, err[-3000:]
    assert not list(state_dir.glob("clusters/*.json"))
    assert "Traceback" not in err, err[-3000:]
    if fake.deleted:
        assert "interrupted: terminating the 1 instance(s) this attempt created" in err


# (what, method, path pattern, hold the request). The create is not held: the vendor acts on it
# and its answer may be lost, which the abort finds by the attempt's label.
VENDOR_STEPS = [
    ("offer search", "POST", r"/bundles/$", True),
    ("create", "PUT", r"/asks/\d+/$", False),
    ("key attach", "POST", r"/instances/\d+/ssh/$", True),
    ("boot poll", "GET", r"/instances/\d+/$", True),
]


@pytest.mark.parametrize("what,method,pattern,hold", VENDOR_STEPS, ids=[s[0] for s in VENDOR_STEPS])
def test_ctrl_c_at_each_vendor_request_of_up(cloud_up, ctrl_c, project, state_dir, what, method, pattern, hold):
    fake, _proxy = cloud_up

    def hook(req_method: str, path: str) -> None:
        if req_method == method and re.search(pattern, path):
            ctrl_c.press(hold)

    fake.on_request = hook
    rc, err, took = ctrl_c.up(project)
    assert_left_nothing(fake, state_dir, rc, err, took)
    if what == "offer search":
        assert not fake.created_bodies and not fake.deleted
    else:
        assert fake.deleted == [7000001], err[-3000:]


# The SSH conversation, by the proxy's count of server-to-client chunks: connection 1 is the
# banner probe; on connection 2 (paramiko) chunk 1 is the banner, 2 the key exchange init, 3 its
# reply, 6 inside authentication, 9 the session channel for the first command.
SSH_STEPS = [("banner probe", 1, 1), ("ssh banner", 2, 1), ("kex init", 2, 2), ("kex reply", 2, 3)]
SSH_STEPS += [("auth", 2, 6), ("first command", 2, 9)]


@pytest.mark.parametrize("what,conn,nth", SSH_STEPS, ids=[s[0] for s in SSH_STEPS])
def test_ctrl_c_at_each_ssh_step_of_up_while_the_node_stalls(cloud_up, ctrl_c, project, state_dir, what, conn, nth):
    fake, proxy = cloud_up
    seen = {"down": 0}

    def hook(chunk_conn: int, direction: str, _data: bytes) -> None:
        if chunk_conn == conn and direction == "down":
            seen["down"] += 1
            if seen["down"] == nth:
                ctrl_c.press(hold=True)  # the node stops answering right there

    proxy.on_chunk = hook
    rc, err, took = ctrl_c.up(project)
    assert_left_nothing(fake, state_dir, rc, err, took)
    assert fake.deleted == [7000001]


def test_a_second_ctrl_c_cannot_cut_the_terminate_call_short(cloud_up, ctrl_c, project, state_dir):
    fake, _proxy = cloud_up
    said_again = threading.Event()

    def hook(method: str, path: str) -> None:
        if method == "GET" and re.search(r"/instances/\d+/$", path):
            ctrl_c.press()
        elif method == "DELETE" and ctrl_c.proc is not None:  # the abort's terminate call, held 2 s
            ctrl_c.proc.send_signal(signal.SIGINT)
            said_again.wait(2)

    fake.on_request = hook
    rc, err, took = ctrl_c.up(project)
    assert "Ctrl-C: still terminating (at most" in err and "stopping now would leave the instance running" in err
    assert_left_nothing(fake, state_dir, rc, err, took)


def test_a_second_ctrl_c_stops_only_the_wait_and_down_finishes(cloud_up, ctrl_c, project, state_dir, gpuctl):
    fake, _proxy = cloud_up
    real_handle, lingering = fake.handle, []

    def slow_to_go(method: str, path: str, body, query: dict):
        if method == "DELETE":  # accepted; the vendor lists it for a while yet
            lingering.append(path)
            return 200, {"success": True}
        return real_handle(method, path, body, query)

    def hook(method: str, path: str) -> None:
        if method == "GET" and re.search(r"/instances/\d+/$", path):
            ctrl_c.press()
        elif method == "GET" and path.endswith("/instances/") and lingering and ctrl_c.proc is not None:
            ctrl_c.proc.send_signal(signal.SIGINT)  # during the wait for "gone"

    fake.handle, fake.on_request = slow_to_go, hook
    rc, err, took = ctrl_c.up(project)
    assert rc == 130 and took < EXIT_WITHIN_S, err
    assert "Ctrl-C: stopped waiting: vast still lists instance(s) 7000001 (their terminate was accepted)" in err
    assert "cluster vast-t stays recorded with vast instance(s) 7000001: run `gpuctl down`" in err
    assert [p.name for p in state_dir.glob("clusters/*.json")] == ["vast-t.json"]
    fake.handle, fake.on_request = real_handle, None  # the vendor catches up
    down = gpuctl("down", "--yes")
    assert down.returncode == 0, down.stderr
    assert not fake.instances and not list(state_dir.glob("clusters/*.json"))


def test_an_abort_that_outlasts_its_bound_says_what_is_left(
    cloud_up, project, tmp_path, state_dir, gpuctl, monkeypatch
):
    """Two nodes, the vendor hangs on the first one's terminate: the second is terminated all
    the same, and the abort gives up on the first after ABORT_S, leaving it recorded for `down`."""
    from provision.flows import cluster

    fake, _proxy = cloud_up
    write_config(project, {"kind": "vast", "api_url": fake.url, **node_fields(tmp_path), "nodes": 2}, name="vast-t")
    monkeypatch.setattr(abort, "ABORT_S", 2.0)
    real_view, hung = fake._view, threading.Event()
    monkeypatch.setattr(fake, "_view", lambda inst, count=True: {**real_view(inst, count), "actual_status": "exited"})
    fake.on_request = lambda method, path: hung.wait(30) if method == "DELETE" and "7000001" in path else None
    said: list[str] = []
    started = time.monotonic()
    try:
        with pytest.raises(ProviderError, match="ended in state 'exited'"):
            cluster.up(load_config(project / "gpuctl.yaml"), UpOptions(assume_yes=True, say=said.append))
        took = time.monotonic() - started
        assert list(fake.instances) == [7000001] and fake.deleted == [7000002]
    finally:
        hung.set()
    assert took < 2.0 + EXIT_WITHIN_S, said
    assert "up failed: terminating the 2 instance(s) this attempt created (at most 2 s)" in said
    assert (
        "could not terminate vast instance 7000001: vast did not answer within the 2 s an abort may take"
        in " ".join(said)
    )
    assert (
        said[-1]
        == "cluster vast-t stays recorded with vast instance(s) 7000001: run `gpuctl down` to finish removing it"
    )
    fake.on_request = None
    monkeypatch.setattr(fake, "_view", real_view)
    assert gpuctl("down", "--yes").returncode == 0
    wait_until(lambda: not fake.instances, 10, "the held DELETE to land too")
    assert not list(state_dir.glob("clusters/*.json"))


def test_ctrl_c_after_the_provider_returned_still_terminates(cloud_up, project, state_dir, monkeypatch):
    """The last steps of `up` (record, image, ssh_config) are `up` too: a Ctrl-C there undoes it."""
    from provision.flows import cluster
    from provision.transport.ssh import client_config

    fake, _proxy = cloud_up

    def pressed() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(client_config, "refresh", pressed)
    said: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        cluster.up(load_config(project / "gpuctl.yaml"), UpOptions(assume_yes=True, say=said.append))
    assert "interrupted: terminating the 1 instance(s) this attempt created (at most 60 s)" in said
    assert not fake.instances and fake.deleted == [7000001]
    assert not list(state_dir.glob("clusters/*.json"))


def test_ctrl_c_during_down_keeps_the_cluster_recorded_for_the_next_down(cloud_up, ctrl_c, project, state_dir, gpuctl):
    from provision.flows import cluster

    fake, _proxy = cloud_up
    cluster.up(load_config(project / "gpuctl.yaml"), UpOptions(assume_yes=True, say=lambda _line: None))
    fake.on_request = lambda method, path: ctrl_c.press(hold=True) if method == "DELETE" else None
    ctrl_c.proc = subprocess.Popen(
        [*GPUCTL, "down", "--yes"], cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _out, err = ctrl_c.proc.communicate(timeout=60)
    finally:
        ctrl_c.release.set()
    assert ctrl_c.pressed_at is not None and time.monotonic() - ctrl_c.pressed_at < EXIT_WITHIN_S, err
    assert ctrl_c.proc.returncode == 130, err
    assert "interrupted: cluster vast-t stays recorded; run `gpuctl down` again to finish removing it" in err
    assert [p.name for p in state_dir.glob("clusters/*.json")] == ["vast-t.json"]
    fake.on_request = None
    again = gpuctl("down", "--yes")
    assert again.returncode == 0, again.stderr
    assert not fake.instances and not list(state_dir.glob("clusters/*.json"))


def test_ctrl_c_during_run_before_it_follows_takes_the_cluster_down(cloud_up, ctrl_c, project, state_dir, tmp_path):
    """`gpuctl run` pressed while it ships the bundle: the `down` of `run` still happens."""
    fake, _proxy = cloud_up
    runs = tmp_path / "node" / "runs"
    watcher = threading.Thread(
        target=lambda: (
            wait_until(lambda: runs.is_dir() and any(runs.iterdir()), 60, "the bundle", every=0.01),
            ctrl_c.press(),
        ),
        daemon=True,
    )
    ctrl_c.proc = subprocess.Popen(
        [*GPUCTL, "run", "--yes"], cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    watcher.start()
    _out, err = ctrl_c.proc.communicate(timeout=120)
    assert ctrl_c.proc.returncode == 130, err[-3000:]
    assert ctrl_c.pressed_at is not None and time.monotonic() - ctrl_c.pressed_at < 3 * EXIT_WITHIN_S, err[-3000:]
    assert "interrupted before the run was followed: taking cluster vast-t down" in err
    assert "cluster vast-t is down" in err and not fake.instances and fake.deleted == [7000001]
    assert not list(state_dir.glob("clusters/*.json"))


@pytest.mark.parametrize("request_name", ["exec", "sftp"])
def test_a_channel_request_without_answer_times_out(sshd, request_name):
    """paramiko waits for the answer to exec_command and to the sftp subsystem with no timeout of its
    own; SSHNode sends both through answered_within (a node that stops answering must not hold
    `up`, `train` or `down`)."""
    from provision.transport.ssh.node import SSHNode

    release = threading.Event()
    with TcpProxy(("127.0.0.1", sshd.port)) as proxy:
        node = SSHNode("127.0.0.1", proxy.port, sshd.user, str(sshd.client_key), pin_new=True)
        assert node.sh("echo hi", timeout=30).stdout == "hi\n"
        chan = node.client().get_transport().open_session(timeout=10)
        proxy.on_chunk = lambda _conn, direction, _data: release.wait(30) if direction == "down" else None
        send = (
            (lambda: chan.exec_command("true")) if request_name == "exec" else (lambda: chan.invoke_subsystem("sftp"))
        )
        try:
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                channel.answered_within(chan, send, 1.0)
            assert time.monotonic() - started < 5
        finally:
            release.set()
            node.drop_connection()


def test_a_ctrl_c_inside_a_vendor_request_is_not_retried(monkeypatch):
    """tenacity catches every exception of an attempt; a KeyboardInterrupt must leave at once."""
    from provision.providers.http import JsonApi, RetryPolicy

    calls = []

    def interrupted(self, method: str, path: str, body) -> None:
        calls.append(path)
        raise KeyboardInterrupt

    monkeypatch.setattr(JsonApi, "_once", interrupted)
    client = JsonApi("Fake", "http://127.0.0.1:9", "k-123", "$K", RetryPolicy(attempts=6, first_wait_s=5))
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        client.request("GET", "/instances/")
    assert calls == ["/instances/"] and time.monotonic() - started < 1


# --- the root cause: a press swallowed by a finalizer --------------------------------------------


@pytest.fixture
def sigint_recorded(monkeypatch):
    """gpuctl's SIGINT handler in this process (as the CLI installs it), fresh state."""
    previous = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(interrupt, "_STATE", interrupt._Presses())
    interrupt.install()
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_that_a_finalizer_swallowed_is_raised_at_the_next_check(sigint_recorded, monkeypatch):
    lost: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: lost.append(info.exc_value))

    class Finalized:  # like importlib's module-lock callback or filelock's __del__
        def __del__(self) -> None:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # the handler runs here, inside the finalizer
                pass

    Finalized()  # dropped at once: the KeyboardInterrupt is raised in __del__ and swallowed
    assert len(lost) == 1 and isinstance(lost[0], KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        interrupt.check()
    interrupt.answered()
    interrupt.check()  # answered: nothing more


def test_presses_inside_a_shield_are_counted_and_a_deferred_step_raises_after(sigint_recorded):
    with interrupt.shielded() as shield:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        wait_until(lambda: shield.presses == 2, 5, "the presses to be counted", every=0.01)
        interrupt.check()  # no raise inside a shield
    with pytest.raises(KeyboardInterrupt):
        with interrupt.deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            done = True  # the step finished before the press took effect
    assert done


def press_and_spin() -> None:
    """A Ctrl-C to this process; the handler runs within the loop (or raises out of it)."""
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(10_000):
        pass


def test_clean_up_runs_while_the_ctrl_c_is_on_its_way(sigint_recorded):
    """A `docker logout` in a finally block still runs: check() re-raises only a swallowed press."""
    ran = []
    with pytest.raises(KeyboardInterrupt):
        try:
            press_and_spin()
        finally:
            interrupt.check()
            ran.append("clean-up")
    assert ran == ["clean-up"]
    with pytest.raises(KeyboardInterrupt):  # and a further press cuts clean-up short, as it always did
        try:
            press_and_spin()
        finally:
            press_and_spin()


def test_in_the_guarded_region_a_second_press_waits_for_the_abort(sigint_recorded):
    with interrupt.guarded():
        try:
            press_and_spin()
            raise AssertionError("the first press raises")
        except KeyboardInterrupt:
            press_and_spin()  # a double Ctrl-C: counted, not raised before the abort starts
            with pytest.raises(KeyboardInterrupt):
                interrupt.check()  # vendor clean-up inside yields to the abort
            interrupt.answered()  # the abort starts
    assert interrupt._STATE.total == 2 and not interrupt._STATE.pending

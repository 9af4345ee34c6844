"""Provider vast against a fake Vast.ai API whose instances are the loopback test sshd.

Fast tests drive the provider in-process or gpuctl as a subprocess without training; the slow
ones train for real (CPU ranks: the stand-in node shows no GPU) and let the node delete itself.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest

from provision.core.config import load_config
from provision.core.errors import ProviderError
from provision.core.provider_config import VastProvider
from provision.providers import vast
from provision.providers.base import UpOptions
from tests.fakes.harness import (
    assert_secret_absent,
    node_fields,
    saved_run,
    serve_vast,
    text_once_it_says,
    wait_until,
    write_config,
)
from tests.fakes.vast_api import PULL_MSG
from tests.helpers import GPUCTL

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def fake(sshd, monkeypatch):
    yield from serve_vast(sshd, monkeypatch)


def provider(fake, tmp_path, **extra) -> dict:
    return {"kind": "vast", "api_url": fake.url, **node_fields(tmp_path), **extra}


def up_in_process(project, fake, tmp_path, **extra):
    write_config(project, provider(fake, tmp_path, **extra), name="vast-t")
    cfg = load_config(project / "gpuctl.yaml")
    said: list[str] = []
    from provision.flows import cluster

    record = cluster.up(cfg, UpOptions(assume_yes=True, say=said.append))
    return cfg, record, said


def test_search_query_units_filters_and_cheapest_first(fake):
    prov = VastProvider(api_url=fake.url, min_ram_gb=128, disk_gb=200, max_price=2.0, min_upload_mbps=100)
    query = vast.search_query(prov)
    assert query["cuda_max_good"] == {"gte": 12.8} and query["inet_up"] == {"gte": 100}  # Mbit/s, as Vast has it
    assert "inet_up" not in vast.search_query(VastProvider())  # unsized: plan did not say (sized_provider does)
    assert query["cpu_ram"] == {"gte": 128_000}  # the API counts MB (the vastai CLI: GB x 1000)
    assert query["disk_space"] == {"gte": 200} and query["dph_total"] == {"lte": 2.0}
    assert query["gpu_name"] == {"eq": "RTX 4090"} and query["num_gpus"] == {"eq": 3}
    assert query["rentable"] == {"eq": True} and query["verified"] == {"eq": True}
    assert query["external"] == {"eq": False} and query["rented"] == {"eq": False}  # the client's defaults
    assert query["reliability"] == {"gte": 0.98} and query["order"] == [["dph_total", "asc"]]
    offers = vast.BACKEND.find_offers(prov)
    assert [o.id for o in offers] == ["1001", "1003"]  # not 1008: external; 1009: CUDA 12.4; 1010: no uplink
    assert offers[0].price_per_hour == 1.05 and offers[0].ram_gb == 257 and offers[0].num_gpus == 3


def test_offers_command_prints_the_table(project, gpuctl, fake, tmp_path):
    write_config(project, provider(fake, tmp_path), name="vast-t")
    result = gpuctl("offers")
    assert result.returncode == 0, result.stderr
    assert "1001" in result.stdout and "1.050" in result.stdout and "1003" in result.stdout
    assert "1002" not in result.stdout  # 64 GB RAM: filtered out
    rows = json.loads(gpuctl("offers", "--json").stdout)
    assert [r["id"] for r in rows] == ["1001", "1003"]


def test_no_offer_is_one_line_with_the_filters(project, gpuctl, fake, tmp_path):
    write_config(project, provider(fake, tmp_path, max_price=0.5), name="vast-t")
    result = gpuctl("up", "--yes")
    assert result.returncode == 5
    lines = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1
    assert "no vast offer matches (gpu_name=RTX 4090, num_gpus=3, cpu_ram>=128 GB" in lines[0]
    assert "dph_total<=$0.5/h" in lines[0] and "gpuctl offers" in lines[0]
    assert not fake.instances and not any(m == "PUT" for m, _ in fake.requests)


def test_dry_run_shows_the_pick_and_price_and_creates_nothing(project, gpuctl, fake, tmp_path):
    write_config(project, provider(fake, tmp_path, max_hours=2), name="vast-t")
    result = gpuctl("up", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "offer 1001: 3 x RTX 4090 at $1.050/h" in result.stderr
    assert "budget cap 2.00 h = $2.10" in result.stderr
    assert [m for m, _ in fake.requests] == ["POST"] and not fake.instances


def test_up_prints_the_first_step_estimate_before_renting(project, gpuctl, fake, tmp_path):
    # runtime bootstrap (no provider.image): the pinned image's size at the offer's inet_down (900 Mbit/s)
    write_config(
        project,
        provider(fake, tmp_path, image=None),
        name="vast-t",
        model="deepseek-ai/deepseek-llm-7b-base",
        zero_stage=3,
    )
    result = gpuctl("up", "--dry-run")
    assert result.returncode == 0, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("first step in ~")]
    assert "image pull 2 min: 10 GB at 112 MB/s" in line and "node-side install" in line
    assert "ops 2 min: op cache not checked, counted as a miss (compile)" in line
    assert "model download 2 min: 13.8 GB of weights at 900 Mbit/s" in line
    # the prebuilt image: no install, its ops prebuilt, its size unknown to gpuctl (said)
    write_config(project, provider(fake, tmp_path), name="vast-t")
    line = next(x for x in gpuctl("up", "--dry-run").stderr.splitlines() if x.startswith("first step in ~"))
    assert "image size unknown" in line and "node-side install" not in line and "model download" not in line


def test_up_asks_first_and_a_no_creates_nothing(project, gpuctl, fake, tmp_path):
    write_config(project, provider(fake, tmp_path), name="vast-t")
    result = gpuctl("up", input="n\n")
    assert result.returncode == 1
    assert "create 1 vast node(s) at $1.050/h?" in result.stderr
    assert "nothing was created" in result.stderr and not fake.instances


def test_wrong_key_is_a_clear_line_without_the_key(project, gpuctl, fake, tmp_path, state_dir):
    write_config(project, provider(fake, tmp_path), name="vast-t")
    wrong = "vast-WRONG-key-5f3a9c1e"
    for cmd in (["offers"], ["up", "--yes"]):
        result = gpuctl(*cmd, env={"VAST_API_KEY": wrong})
        assert result.returncode == 5, result.stderr
        assert "Vast.ai rejected the API key from $VAST_API_KEY (HTTP 401)" in result.stderr
        assert_secret_absent(wrong, result.stdout, result.stderr, dirs=(state_dir,))


def test_key_from_the_vast_api_key_file(project, gpuctl, fake, tmp_path, monkeypatch):
    monkeypatch.delenv("VAST_API_KEY")
    write_config(project, provider(fake, tmp_path), name="vast-t")
    home = tmp_path / "home"
    home.mkdir()
    missing = gpuctl("offers", env={"HOME": str(home)})
    assert missing.returncode == 5 and "~/.vast_api_key" in missing.stderr
    (home / ".vast_api_key").write_text(fake.key + "\n")
    found = gpuctl("offers", env={"HOME": str(home)})
    assert found.returncode == 0 and "1001" in found.stdout


def test_up_waits_for_ssh_records_price_and_down_is_idempotent(project, gpuctl, fake, tmp_path, state_dir):
    cfg, record, said = up_in_process(project, fake, tmp_path)
    node = record.nodes[0]
    assert record.provider == "vast" and record.price_per_hour == 1.05
    assert node.instance_id == "7000001" and node.address == "127.0.0.1" and node.port == fake.ssh.port
    assert node.slots == 3 and node.accelerator == "cpu"  # no GPU on the stand-in: CPU ranks
    assert any("shows no GPU" in line for line in said)
    # the image pull as far as Vast reports it, timed; `up`'s estimate kept for the first run's summary
    assert f"vast instance 7000001: loading ({PULL_MSG})" in said
    assert node.boot_s is not None and any(f"image pulled and booted in {node.boot_s:.0f}s" in x for x in said)
    assert record.startup_estimate and "image pull" in record.startup_estimate
    body = fake.created_bodies[0]
    assert body["image"] == cfg.provider.image and body["runtype"] == "ssh_direc ssh_proxy"
    assert body["client_id"] == "me" and body["cancel_unavail"] is True and body["onstart"] == vast.ONSTART
    assert body["disk"] == 200 and re.fullmatch(r"gpuctl-vast-t-0-[0-9a-f]{6}", body["label"])
    assert fake.instances[7000001]["_keys"] == [(state_dir / "keys" / "vast-t" / "id_ed25519.pub").read_text().strip()]
    status = json.loads(gpuctl("status", "--json").stdout)
    assert status["cluster"]["price_per_hour"] == 1.05
    shown = gpuctl("status")
    assert "cost so far: $" in shown.stdout and "at $1.050/h" in shown.stdout

    first = gpuctl("down", "--yes")
    assert first.returncode == 0, first.stderr
    assert "terminated 1 vast instance(s); vast no longer lists them" in first.stderr
    assert not fake.instances and fake.deleted == [7000001]
    second = gpuctl("down", "--yes")
    assert second.returncode == 0 and "not up; nothing to do" in second.stderr
    assert not (state_dir / "keys" / "vast-t").exists()


def test_down_of_an_instance_that_is_already_gone(project, gpuctl, fake, tmp_path):
    _cfg, record, _ = up_in_process(project, fake, tmp_path)
    fake.instances.clear()  # deleted behind gpuctl's back (or by itself)
    result = gpuctl("down", "--yes")
    assert result.returncode == 0, result.stderr
    assert "vast no longer lists them" in result.stderr


def test_down_fails_loudly_while_the_vendor_still_lists_it(project, fake, tmp_path, monkeypatch):
    _cfg, record, _ = up_in_process(project, fake, tmp_path)
    monkeypatch.setattr(vast.VastBackend, "terminate", lambda self, cluster, iid: None)  # a DELETE that did nothing
    with pytest.raises(ProviderError) as err:
        vast.BACKEND.wait_gone(record, ["7000001"], timeout_s=1)
    assert "still lists instance(s) 7000001" in err.value.one_line()


def test_a_node_that_dies_while_booting_is_terminated(project, fake, tmp_path, state_dir, monkeypatch):
    real_view = fake._view

    def exited(inst, count=True):  # the list's view too (count=False): a TypeError there is a 500
        view = real_view(inst, count)
        view["actual_status"] = "exited" if inst["_reads"] > 1 else view["actual_status"]
        view["status_msg"] = None if inst["_reads"] > 1 else view["status_msg"]  # no pull after the exit
        return view

    monkeypatch.setattr(fake, "_view", exited)
    with pytest.raises(ProviderError) as err:
        up_in_process(project, fake, tmp_path)
    assert "ended in state 'exited'" in err.value.one_line()
    assert not fake.instances and fake.deleted == [7000001]
    assert not list(state_dir.glob("clusters/*.json"))


def test_a_create_whose_answer_is_lost_is_not_retried_and_not_leaked(project, fake, tmp_path, state_dir):
    fake.lose_create_answer = True  # Vast created it, then the answer was a 502
    with pytest.raises(ProviderError) as err:
        up_in_process(project, fake, tmp_path)
    assert "PUT /api/v0/asks/1001/: HTTP 502" in err.value.one_line() and "(1 try)" in err.value.one_line()
    assert [m for m, p in fake.requests].count("PUT") == 1  # a create is never retried after a 5xx
    assert not fake.instances and fake.deleted == [7000001]  # found by this attempt's label, terminated
    assert not list(state_dir.glob("clusters/*.json"))


def test_a_node_without_gpu_is_an_error_unless_cpu_fallback(project, fake, tmp_path):
    with pytest.raises(ProviderError) as err:
        up_in_process(project, fake, tmp_path, cpu_ranks_fallback=None)
    assert "shows no GPU" in err.value.one_line() and not fake.instances


def test_down_when_the_node_already_deleted_itself_mid_run(project, gpuctl, fake, tmp_path, state_dir):
    from provision.core import state

    _cfg, record, _ = up_in_process(project, fake, tmp_path)
    saved_run(record.name, "r1")
    fake.instances.clear()  # the node tore itself down (budget cap) and took its SSH key along
    fake.ssh.remove_key((state_dir / "keys" / "vast-t" / "id_ed25519.pub").read_text())
    shown = gpuctl("status")
    assert shown.returncode == 0 and "cannot reach the node" in shown.stderr and "cost so far" in shown.stdout
    result = gpuctl("down", "--yes")
    assert result.returncode == 0, result.stderr
    assert "cannot reach the node of run r1" in result.stderr
    assert state.load_run("r1").state == "lost"


def test_two_nodes_take_the_two_cheapest_offers_and_end_together(project, gpuctl, fake, tmp_path):
    fake.addresses = ("127.0.0.1", "127.0.0.2")
    _cfg, record, said = up_in_process(project, fake, tmp_path, nodes=2)
    assert [n.instance_id for n in record.nodes] == ["7000001", "7000002"]
    assert [n.address for n in record.nodes] == ["127.0.0.1", "127.0.0.2"]
    assert record.price_per_hour == pytest.approx(1.05 + 1.45)
    assert any("node-to-node SSH ready" in line for line in said)
    teardown = vast.BACKEND.self_teardown(record)
    urls = teardown.argv[5::2]
    assert urls == [f"{fake.url}/api/v0/instances/7000002/", f"{fake.url}/api/v0/instances/7000001/"]  # own last
    assert gpuctl("down", "--yes").returncode == 0
    assert not fake.instances and sorted(fake.deleted) == [7000001, 7000002]


def test_ctrl_c_during_up_after_create_leaves_nothing(project, fake, tmp_path, state_dir):
    fake.boot_polls = 10**6  # it never finishes booting
    write_config(project, provider(fake, tmp_path), name="vast-t")
    polls = []

    def ctrl_c_at_the_second_boot_poll(method: str, path: str) -> None:  # well inside the boot wait
        if method == "GET" and re.fullmatch(r"/api/v0/instances/\d+/", path):
            polls.append(time.monotonic())
            if len(polls) == 2:
                proc.send_signal(signal.SIGINT)

    fake.on_request = ctrl_c_at_the_second_boot_poll
    proc = subprocess.Popen(
        [*GPUCTL, "up", "--yes"], cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.monotonic() - polls[1] < 20, err  # answered at once (tests/test_ctrl_c.py: each step)
    assert proc.returncode == 130, err
    assert "interrupted: terminating the 1 instance(s) this attempt created" in err
    assert not fake.instances and fake.deleted == [7000001]
    assert not list(state_dir.glob("clusters/*.json"))


def test_the_node_teardown_command_is_python_urllib_with_the_key_in_env(project, fake, tmp_path):
    _cfg, record, _ = up_in_process(project, fake, tmp_path)
    teardown = vast.BACKEND.self_teardown(record)
    assert teardown.argv[1] == "-c" and "urllib.request" in teardown.argv[2]
    assert teardown.argv[3:] == ["teardown", "DELETE", f"{fake.url}/api/v0/instances/7000001/", "{}"]  # client's body
    assert teardown.env == {"GPUCTL_TEARDOWN_KEY": fake.key}
    assert fake.key not in " ".join(teardown.argv)
    # run it as the node would: the fake deletes the instance
    done = subprocess.run(teardown.argv, env={**os.environ, **teardown.env}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not fake.instances
    again = subprocess.run(teardown.argv, env={**os.environ, **teardown.env}, capture_output=True, timeout=60)
    assert again.returncode == 0  # 404: already gone is done


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_budget_cap_tears_the_node_down_even_if_the_run_goes_on(project, gpuctl, fake, tmp_path):
    # $0.015 at $1.05/h is ~51 s from creation; the run would take many minutes. One rank: the cap
    # acts on the node, not on the ranks, and two more would only load the machine until it hits.
    write_config(
        project, provider(fake, tmp_path, max_cost=0.015, cpu_ranks_fallback=1), name="vast-cap", max_steps=100000
    )
    up = gpuctl("up", "--yes")
    assert up.returncode == 0, up.stderr
    assert "budget cap 0.9 min = $0.01" in up.stderr
    assert "warning: the run cannot finish before the budget cap: provider.max_cost $0.015" in up.stderr
    refused = gpuctl("train", "--detach")  # the prediction's low end is past the cap: nothing starts
    assert refused.returncode == 1 and "--force trains anyway" in refused.stderr
    started = gpuctl("train", "--detach", "--force")  # the cap must hold for a run that goes on
    assert started.returncode == 0, started.stderr
    wait_until(lambda: not fake.instances, 180, "the budget guard to delete the node", every=1)
    run_dir = next((tmp_path / "node" / "runs").iterdir())
    log = text_once_it_says(tmp_path / "node" / "guard" / "guard.log", "self-teardown accepted")  # `up` started it
    assert "budget cap reached" in log and "stopped run" in log
    wait_until(lambda: json.loads((run_dir / "status.json").read_text())["state"] == "cancelled", 60, "the run to stop")
    down = gpuctl("down", "--yes")
    assert down.returncode == 0, down.stderr

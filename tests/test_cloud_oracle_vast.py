"""The official Vast.ai client (PyPI `vastai`, pinned in the test extra) is the oracle: its own
request builders run against the fake Vast.ai server, and what it sends is compared, field by
field, with what gpuctl sends for the same intent (paths, methods, field names, units, operators).
The fake answers both, so its answers are checked against what the client parses too.
"""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

import pytest
from vastai import VastAI
from vastai.api import offers as vast_offers

from provision.core.provider_config import IMAGE_CUDA, VastProvider
from provision.core.state import ClusterRecord
from provision.providers import vast
from provision.providers.base import Offer
from tests.fakes.oracle import differences
from tests.fakes.vast_api import FakeVast, offer

pytestmark = pytest.mark.timeout(120)
KEY_LINE = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOracleOracleOracleOracleOracleOracle000 gpuctl"
# min_upload_mbps 430: DeepSeek-7B's final checkpoint (96.7 GB on node 0) within 30 minutes
FILTERS = {"min_ram_gb": 128, "disk_gb": 200, "max_price": 2.0, "reliability": 0.98, "min_upload_mbps": 430}
# the same intent in the client's own query language (`vastai search offers '...'`): its field
# `cuda_vers` is an alias of cuda_max_good, inet_up is Mbit/s
QUERY = (
    "gpu_name=RTX_4090 num_gpus=3 reliability>=0.98 cpu_ram>=128 disk_space>=200 direct_port_count>=1 dph_total<=2.0"
    f" cuda_vers>={IMAGE_CUDA} inet_up>=430"
)


@pytest.fixture
def fake(monkeypatch):
    with FakeVast() as server:
        monkeypatch.setenv("VAST_API_KEY", server.key)
        yield server


@pytest.fixture
def prov(fake):
    return VastProvider(api_url=fake.url, **FILTERS)


@pytest.fixture
def official(fake):
    return VastAI(api_key=fake.key, server_url=fake.origin, retry=1)


def record(fake) -> ClusterRecord:
    return ClusterRecord(name="oracle", provider="vast", nodes=[], api_url=fake.url)


def sent(fake, since: int, method: str | None = None):
    calls = [c for c in fake.calls[since:] if method is None or c.method == method]
    assert calls, f"no {method or ''} request was sent"
    return calls


def test_the_pinned_client_is_the_one_installed():
    pin = re.search(r'"vastai==([^"]+)"', (Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert pin and version("vastai") == pin[1], "the test extra pins another vastai than the one installed"


def test_search_offers(fake, official, prov):
    fake.offers.append(offer(1011, price=0.6, inet_up=300))  # 300 Mbit/s: 96.7 GB would take 43 min
    start = len(fake.calls)
    theirs = official.search_offers(query=QUERY, order="dph_total", limit=vast.SEARCH_LIMIT, storage=prov.disk_gb)
    (their_call,) = sent(fake, start)
    start = len(fake.calls)
    ours = vast.BACKEND.find_offers(prov)
    (our_call,) = sent(fake, start)
    assert (our_call.method, our_call.path) == (their_call.method, their_call.path) == ("POST", "/api/v0/bundles/")
    problems = differences(
        "search offers",
        our_call.body,
        their_call.body,
        client="vastai",
        ours_only={"rented": "a default of the client's api-level search_offers; its query-string path leaves it out"},
    )
    assert not problems, "\n".join(problems)
    assert their_call.body["cuda_max_good"] == {"gte": IMAGE_CUDA}  # the client's alias, sent as text
    assert our_call.body["cuda_max_good"] == {"gte": 12.8} and our_call.body["inet_up"] == {"gte": 430}
    # not 1009 (a CUDA 12.4 driver), 1010 (a dead uplink), 1011 (300 Mbit/s)
    assert [o.id for o in ours] == [str(o["id"]) for o in theirs] == ["1001", "1003"]


def test_search_defaults_of_the_api_layer_are_all_sent(fake, prov):
    """vastai/api/offers.py search_offers(no_default=False): every default it adds, gpuctl sends."""
    client = VastAI(api_key=fake.key, server_url=fake.origin, retry=1).client
    start = len(fake.calls)
    vast_offers.search_offers(client, query={}, order=[["dph_total", "asc"]], limit=64, storage=prov.disk_gb)
    (defaults,) = sent(fake, start)
    ours = vast.search_query(prov)
    for name, cond in defaults.body.items():
        assert name in ours, f"search offers: field {name}: the client's default {cond!r} is not sent by gpuctl"
        assert ours[name] == cond, f"search offers: field {name}: gpuctl sends {ours[name]!r}, the client {cond!r}"


def test_create_instance_and_attach_key(fake, official, prov):
    cluster = record(fake)
    label = "gpuctl-oracle-0-abc123"
    start = len(fake.calls)
    their_answer = official.create_instance(
        id=1001,
        image=vast.boot_image(prov, "vast"),  # no provider.image: the pinned PyTorch image, bootstrapped
        disk=prov.disk_gb,
        env={"GPUCTL_CLUSTER": cluster.name},
        label=label,
        onstart_cmd=vast.ONSTART,
        cancel_unavail=True,
        ssh=True,
        direct=True,
    )
    (their_create,) = sent(fake, start)
    official.attach_ssh(their_answer["new_contract"], KEY_LINE)
    their_key = fake.calls[-1]
    fake.offers[0]["rented"] = False  # the same offer again, for gpuctl
    start = len(fake.calls)
    offer = Offer(id="1001", gpu_name="RTX 4090", num_gpus=3, price_per_hour=1.05)
    instance_id = vast.BACKEND.launch(prov, cluster, label, offer, KEY_LINE)  # the create alone (its id is recorded)
    vast.BACKEND.attach(cluster, instance_id, KEY_LINE)  # then the key
    our_create, our_key = sent(fake, start)
    assert (our_create.method, our_create.path) == (their_create.method, their_create.path)
    problems = differences("create instance", our_create.body, their_create.body, client="vastai")
    assert (our_key.method, their_key.method) == ("POST", "POST")
    assert re.sub(r"\d+", "N", our_key.path) == re.sub(r"\d+", "N", their_key.path) == "/api/vN/instances/N/ssh/"
    problems += differences("attach ssh key", our_key.body, their_key.body, client="vastai")
    assert not problems, "\n".join(problems)
    assert their_create.body["runtype"] == "ssh_direc ssh_proxy"  # what ssh=True, direct=True means today


def test_show_destroy_and_list(fake, official):
    cluster = record(fake)
    fake._create(1001, {"image": "x", "label": "one", "env": {"A": "1"}})
    start = len(fake.calls)
    theirs = official.show_instance(7000001)  # parses the fake's answer: extra_env pairs, start_date
    ours = vast.BACKEND.describe(cluster, "7000001")
    their_show, our_show = sent(fake, start)
    assert theirs["extra_env"] == {"A": "1"} and ours is not None and ours.label == theirs["label"]
    assert (our_show.method, our_show.path, our_show.query) == (their_show.method, their_show.path, their_show.query)

    start = len(fake.calls)
    their_rows = official.show_instances()
    our_rows = vast.BACKEND.list_instances(cluster)
    their_list, our_list = sent(fake, start)
    assert [r["id"] for r in their_rows] == [int(i.id) for i in our_rows] == [7000001]
    assert (our_list.method, our_list.path) == (their_list.method, their_list.path) == ("GET", "/api/v1/instances/")
    problems = differences("list instances (query)", our_list.query, their_list.query, client="vastai")

    fake._create(1003, {"image": "x", "label": "two"})
    start = len(fake.calls)
    official.destroy_instance(7000001)
    vast.BACKEND.terminate(cluster, "7000002")
    their_delete, our_delete = sent(fake, start)
    assert (our_delete.method, re.sub(r"\d+", "N", our_delete.path)) == (
        their_delete.method,
        re.sub(r"\d+", "N", their_delete.path),
    )
    problems += differences("destroy instance", {"body": our_delete.body}, {"body": their_delete.body}, client="vastai")
    assert our_delete.body == their_delete.body == {}
    assert not problems, "\n".join(problems)
    assert not fake.instances

"""A vendor that answers in a shape gpuctl does not expect (issue 34, LOW): offers as a list, no
`dph_total`, a `HostPort` that is no number, a dict as `new_contract` or as a pod id. Each is one
`error:` line, no traceback, and nothing stays rented (the fakes keep the instance the mangled
answer hid; `up`'s abort finds it by its label). Then hypothesis over the shapes of the records
the providers read: a ProviderError or a result, never another exception."""

from __future__ import annotations

import copy
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from provision.cli.app import app
from provision.core.errors import ProviderError
from provision.core.provider_config import RunPodProvider, VastProvider
from provision.providers import runpod, vast
from tests.fakes.harness import node_fields, serve_runpod, serve_vast, write_config
from tests.fakes.runpod_api import gpu_type
from tests.fakes.vast_api import offer

pytestmark = pytest.mark.timeout(240)
RUNNER = CliRunner()


@pytest.fixture
def vast_fake(sshd, monkeypatch):
    yield from serve_vast(sshd, monkeypatch)


@pytest.fixture
def runpod_fake(sshd, monkeypatch):
    yield from serve_runpod(sshd, monkeypatch)


def up_fails_in_one_line(project, provider: dict, tmp_path) -> str:
    write_config(project, {**provider, **node_fields(tmp_path), "ready_timeout": 60}, name="shapes")
    result = RUNNER.invoke(app, ["up", "--yes"], env={"GPUCTL_DEBUG": ""})
    assert isinstance(result.exception, SystemExit) and result.exit_code != 0, (result.exception, result.output)
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    return errors[0]


# --- Vast.ai ----------------------------------------------------------------------------------------


def _search_as_list(method, path, body, answer):
    return answer["offers"] if path.endswith("/bundles/") else answer


def _no_dph_total(method, path, body, answer):
    if path.endswith("/bundles/"):
        return {"offers": [{k: v for k, v in o.items() if k != "dph_total"} for o in answer["offers"]]}
    return answer


def _bad_host_port(method, path, body, answer):
    inst = answer.get("instances") if isinstance(answer, dict) and path.startswith("/api/v0/") else None
    if isinstance(inst, dict) and inst.get("ports"):
        inst = copy.deepcopy(inst)
        inst["ports"]["22/tcp"][0]["HostPort"] = "twenty-two"
        return {"instances": inst}
    return answer


def _contract_as_dict(method, path, body, answer):
    if method == "PUT" and "/asks/" in path and answer.get("new_contract"):
        return {"success": True, "new_contract": {"id": answer["new_contract"]}}
    return answer


@pytest.mark.parametrize(
    ("mangle", "said"),
    [
        (_search_as_list, "Vast.ai answered the search with a JSON list, not an object"),
        (_no_dph_total, "Vast.ai answered an offer in a shape gpuctl cannot read: dph_total: Field required"),
        (_bad_host_port, "instance 7000001's port 22 in a shape gpuctl cannot read: HostPort"),
        (_contract_as_dict, "the rental of offer 1001 in a shape gpuctl cannot read: new_contract"),
    ],
)
def test_a_malformed_vast_answer_is_one_line_and_leaves_nothing_rented(project, vast_fake, tmp_path, mangle, said):
    vast_fake.mangle = mangle
    line = up_fails_in_one_line(project, {"kind": "vast", "api_url": vast_fake.url}, tmp_path)
    assert said in line, line
    assert not vast_fake.instances  # what a create made was terminated, a hidden id included


def test_an_unreadable_entry_in_the_vendors_list_does_not_stop_down(project, vast_fake, tmp_path):
    from provision.core.config import load_config
    from provision.flows import cluster
    from provision.providers.base import UpOptions

    write_config(project, {"kind": "vast", "api_url": vast_fake.url, **node_fields(tmp_path)}, name="listed")
    cluster.up(load_config(project / "gpuctl.yaml"), UpOptions(assume_yes=True, say=lambda _: None))
    assert len(vast_fake.instances) == 1

    def odd_entries(method, path, body, answer):
        if path != "/api/v1/instances/":
            return answer
        ours = [{**row, "ssh_port": "twenty-two"} for row in answer["instances"]]  # ours, unreadable
        someone_elses = {"id": 99, "label": "not gpuctl's", "ports": ["odd"], "actual_status": {"x": 1}}
        return {**answer, "instances": [*ours, someone_elses, ["not even an object"]]}

    vast_fake.mangle = odd_entries
    result = RUNNER.invoke(app, ["down", "--yes"])
    assert result.exit_code == 0, result.output
    assert not vast_fake.instances  # ours was terminated and waited for by its id


# --- RunPod -------------------------------------------------------------------------------------------


def _gpu_types_as_object(method, path, body, answer):
    data = answer.get("data") if isinstance(answer, dict) else None
    if isinstance(data, dict) and "gpuTypes" in data:
        return {"data": {"gpuTypes": {"first": data["gpuTypes"][0]}}}
    return answer


def _pod_id_as_dict(method, path, body, answer):
    data = answer.get("data") if isinstance(answer, dict) else None
    if isinstance(data, dict) and isinstance(data.get("podFindAndDeployOnDemand"), dict):
        pod = dict(data["podFindAndDeployOnDemand"])
        pod["id"] = {"id": pod["id"]}
        return {"data": {"podFindAndDeployOnDemand": pod}}
    return answer


def _public_port_as_text(method, path, body, answer):
    data = answer.get("data") if isinstance(answer, dict) else None
    pod = data.get("pod") if isinstance(data, dict) else None
    if isinstance(pod, dict) and pod.get("runtime"):
        pod = copy.deepcopy(pod)
        pod["runtime"]["ports"][0]["publicPort"] = "ssh"
        return {"data": {"pod": pod}}
    return answer


@pytest.mark.parametrize(
    ("mangle", "said"),
    [
        (_gpu_types_as_object, "RunPod answered the GPU types with a JSON dict where a list belongs"),
        (_pod_id_as_dict, "RunPod answered the deploy in a shape gpuctl cannot read: id"),
        (_public_port_as_text, "RunPod answered a pod in a shape gpuctl cannot read: runtime.ports.0.publicPort"),
    ],
)
def test_a_malformed_runpod_answer_is_one_line_and_leaves_nothing_rented(project, runpod_fake, tmp_path, mangle, said):
    runpod_fake.mangle = mangle
    line = up_fails_in_one_line(project, {"kind": "runpod", "api_url": runpod_fake.url}, tmp_path)
    assert said in line, line
    assert not runpod_fake.pods


# --- hypothesis: the records' shapes --------------------------------------------------------------------

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=20)
    | st.sampled_from(["22", "abc", "", "running", "RUNNING", "22/tcp", "1.5"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3),
    max_leaves=8,
)
FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def vast_instance() -> dict:
    return {
        "id": 7000001,
        "actual_status": "running",
        "intended_status": "running",
        "cur_state": "running",
        "label": "gpuctl-x-0-abcdef",
        "public_ipaddr": "127.0.0.1",
        "ports": {"22/tcp": [{"HostIp": "0.0.0.0", "HostPort": "2222"}]},
        "ssh_host": "ssh5.fake.vast.ai",
        "ssh_port": 20001,
    }


def runpod_pod() -> dict:
    return {
        "id": "pod1",
        "name": "gpuctl-x-0-abcdef",
        "desiredStatus": "RUNNING",
        "costPerHr": 1.02,
        "machineId": "m-1",
        "runtime": {
            "ports": [{"ip": "127.0.0.1", "isIpPublic": True, "privatePort": 22, "publicPort": 2222, "type": "tcp"}]
        },
    }


def mutate(data, record: dict):
    """The record with one field (maybe nested) replaced by any JSON value, or removed, or the whole of it."""
    how = data.draw(st.sampled_from(["replace", "remove", "whole", "nested"]))
    if how == "whole":
        return data.draw(JSON)
    out = copy.deepcopy(record)
    key = data.draw(st.sampled_from(sorted(out)))
    if how == "remove":
        del out[key]
    elif how == "nested" and isinstance(out[key], (dict, list)) and out[key]:
        inner = out[key]
        while isinstance(inner, (dict, list)) and inner:
            parent, index = inner, data.draw(st.sampled_from(sorted(inner) if isinstance(inner, dict) else [0]))
            inner = parent[index]
        parent[index] = data.draw(JSON)
    else:
        out[key] = data.draw(JSON)
    return out


def either_result_or_provider_error(call) -> None:
    try:
        call()
    except ProviderError as err:
        assert err.one_line() and "\x1b" not in err.one_line()


@FUZZ
@given(data=st.data())
def test_vast_records_of_any_shape(data):
    raw_offer = mutate(data, offer(1001))
    either_result_or_provider_error(lambda: vast._offer(raw_offer, VastProvider()))
    either_result_or_provider_error(lambda: vast._offer(raw_offer, VastProvider(interruptible=True)))
    raw_instance = mutate(data, vast_instance())
    either_result_or_provider_error(lambda: vast._instance(raw_instance))


@pytest.fixture(scope="module")
def offers_fake():
    """A RunPod API for the search only (no instances, so no sshd), its key in the environment."""
    from tests.fakes.runpod_api import FakeRunPod

    with FakeRunPod() as fake:
        saved = os.environ.get(runpod.KEY_ENV)
        os.environ[runpod.KEY_ENV] = fake.key
        try:
            yield fake
        finally:
            os.environ.pop(runpod.KEY_ENV) if saved is None else os.environ.update({runpod.KEY_ENV: saved})


@FUZZ
@given(data=st.data())
def test_runpod_records_of_any_shape(data, offers_fake):
    raw_pod = mutate(data, runpod_pod())
    either_result_or_provider_error(lambda: runpod._instance(raw_pod))
    row = gpu_type()
    row = {"id": row["id"], "displayName": row["displayName"], "secure": {"uninterruptablePrice": 0.69}}
    answer = {"data": {"gpuTypes": [mutate(data, row)]}}
    offers_fake.mangle = lambda method, path, body, real: answer
    prov = RunPodProvider(api_url=offers_fake.url)
    either_result_or_provider_error(lambda: runpod.BACKEND.find_offers(prov))

"""Provider runpod against a fake RunPod GraphQL API whose pods are the loopback test sshd."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from provision.core.config import load_config
from provision.core.errors import NoOfferError, ProviderError
from provision.core.provider_config import RunPodProvider
from provision.providers import runpod
from provision.providers.base import UpOptions
from tests.fakes.harness import (
    assert_secret_absent,
    node_fields,
    serve_runpod,
    write_config,
)

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def fake(sshd, monkeypatch):
    yield from serve_runpod(sshd, monkeypatch)


def provider(fake, tmp_path, **extra) -> dict:
    return {"kind": "runpod", "api_url": fake.url, **node_fields(tmp_path), **extra}


def up_in_process(project, fake, tmp_path, **extra):
    write_config(project, provider(fake, tmp_path, **extra), name="rp-t")
    cfg = load_config(project / "gpuctl.yaml")
    from provision.flows import cluster

    return cfg, cluster.up(cfg, UpOptions(assume_yes=True, say=lambda _: None))


def test_offers_per_cloud_type_cheapest_first(fake):
    offers = runpod.BACKEND.find_offers(RunPodProvider(api_url=fake.url))
    assert [(o.id, o.price_per_hour) for o in offers] == [("COMMUNITY", 1.02), ("SECURE", 2.07)]  # 3 x per-GPU
    secure = runpod.BACKEND.find_offers(RunPodProvider(api_url=fake.url, cloud_type="SECURE"))
    assert [o.id for o in secure] == ["SECURE"]
    assert runpod.BACKEND.find_offers(RunPodProvider(api_url=fake.url, max_price=1.0)) == []
    spot = runpod.BACKEND.find_offers(RunPodProvider(api_url=fake.url, interruptible=True))
    assert spot[0].spot and spot[0].price_per_hour == pytest.approx(3 * 0.204)


def test_up_prints_the_first_step_estimate_before_renting(project, gpuctl, fake, tmp_path):
    # runtime bootstrap: RunPod's offers say no download speed, so the default rate (500 Mbit/s) counts
    write_config(
        project,
        provider(fake, tmp_path, image=None),
        name="rp-t",
        model="deepseek-ai/deepseek-llm-7b-base",
        zero_stage=3,
    )
    result = gpuctl("up", "--dry-run")
    assert result.returncode == 0, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("first step in ~")]
    assert "image pull 3 min: 10 GB at 62 MB/s" in line and "node-side install" in line
    assert "model download 4 min: 13.8 GB of weights at 500 Mbit/s" in line


def test_no_capacity_for_the_ram_asked_is_one_line(project, gpuctl, fake, tmp_path):
    write_config(project, provider(fake, tmp_path, min_ram_gb=512), name="rp-t")
    result = gpuctl("up", "--yes")
    assert result.returncode == 5
    assert "no runpod offer matches (gpuTypeId=NVIDIA GeForce RTX 4090, gpuCount=3, minMemoryInGb=512" in result.stderr
    assert not fake.pods


def test_deploy_input_has_the_documented_shape(project, fake, tmp_path, state_dir):
    _cfg, record = up_in_process(project, fake, tmp_path)
    sent = fake.deploy_inputs[0]
    assert sent["gpuTypeId"] == "NVIDIA GeForce RTX 4090" and sent["gpuCount"] == 3
    assert sent["ports"] == "22/tcp" and sent["supportPublicIp"] is True and sent["startSsh"] is True
    assert sent["containerDiskInGb"] == 200 and sent["volumeInGb"] == 0 and sent["minMemoryInGb"] == 128
    assert sent["cloudType"] == "COMMUNITY" and sent["imageName"] == "ghcr.io/gpuctl/trainer:0.1.0"
    public = (state_dir / "keys" / "rp-t" / "id_ed25519.pub").read_text().strip()
    assert {"key": "SSH_PUBLIC_KEY", "value": public} in sent["env"]  # RunPod's per-pod key (docs)
    assert not [e for e in sent["env"] if e["key"] == "PUBLIC_KEY"]  # RunPod's own: the account key
    assert {"key": "GPUCTL_SSHD", "value": "1"} in sent["env"]  # the trainer image starts its sshd
    node = record.nodes[0]
    assert node.instance_id == "fakepod000001" and node.port == fake.ssh.port and node.slots == 3
    assert record.price_per_hour == 1.02
    assert all(fake.key not in p for p in fake.raw_paths)  # Bearer header, never ?api_key=
    runpod.BACKEND.down(record, lambda _: None)
    assert not fake.pods and fake.terminated == ["fakepod000001"]
    runpod.BACKEND.down(record, lambda _: None)  # twice: fine


def test_spot_uses_pod_rent_interruptable_with_a_bid(project, fake, tmp_path):
    _cfg, record = up_in_process(project, fake, tmp_path, interruptible=True, bid_per_gpu=0.3)
    sent = fake.deploy_inputs[0]
    assert sent["bidPerGpu"] == 0.3
    runpod.BACKEND.down(record, lambda _: None)


def test_key_from_runpod_config_toml(tmp_path, monkeypatch, fake):
    monkeypatch.delenv("RUNPOD_API_KEY")
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".runpod").mkdir()
    (tmp_path / ".runpod" / "config.toml").write_text(f'[default]\napi_key = "{fake.key}"\n')
    assert runpod.BACKEND.find_offers(RunPodProvider(api_url=fake.url))
    (tmp_path / ".runpod" / "config.toml").write_text(f'apikey = "{fake.key}"\napiurl = "x"\n')  # runpodctl's
    assert runpod.BACKEND.find_offers(RunPodProvider(api_url=fake.url))


def test_wrong_key_is_a_clear_line_without_the_key(project, gpuctl, fake, tmp_path, state_dir):
    write_config(project, provider(fake, tmp_path), name="rp-t")
    wrong = "rp-WRONG-key-77aa55"
    result = gpuctl("up", "--yes", env={"RUNPOD_API_KEY": wrong})
    assert result.returncode == 5
    assert "RunPod rejected the API key from $RUNPOD_API_KEY (HTTP 401)" in result.stderr
    assert_secret_absent(wrong, result.stdout, result.stderr, dirs=(state_dir,))


def test_graphql_errors_and_unknown_fields_are_clear(fake):
    client = runpod.api(fake.url)
    with pytest.raises(NoOfferError):
        runpod.gql(
            client,
            runpod.DEPLOY,
            {
                "input": {
                    "name": "x",
                    "gpuTypeId": "NVIDIA GeForce RTX 4090",
                    "imageName": "x",
                    "cloudType": "ALL",
                    "minMemoryInGb": 999,
                }
            },
        )
    with pytest.raises(ProviderError, match=r"RunPod API error \(HTTP 400\): Cannot query field .bogus. on type .Pod."):
        runpod.gql(client, "query { myself { pods { id bogus } } }")


def test_node_teardown_sends_pod_terminate(project, fake, tmp_path):
    _cfg, record = up_in_process(project, fake, tmp_path)
    teardown = runpod.BACKEND.self_teardown(record)
    assert teardown.argv[3:5] == ["teardown", "POST"] and teardown.argv[5] == fake.url
    assert json.loads(teardown.argv[6])["variables"] == {"input": {"podId": "fakepod000001"}}
    assert fake.key not in " ".join(teardown.argv) and teardown.env == {"GPUCTL_TEARDOWN_KEY": fake.key}
    done = subprocess.run(teardown.argv, env={**os.environ, **teardown.env}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not fake.pods
    again = subprocess.run(teardown.argv, env={**os.environ, **teardown.env}, capture_output=True, timeout=60)
    assert again.returncode == 0  # "Pod not found": already gone is done


def test_the_cluster_key_goes_in_ssh_public_key_and_the_account_key_stays(project, fake, tmp_path, state_dir):
    account = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIAccountKeyOfTheUserxxxxxxxxxxxxxxxxxxxx user@laptop"
    fake.account_key = account  # RunPod injects it as PUBLIC_KEY; gpuctl must not override it
    _cfg, record = up_in_process(project, fake, tmp_path)  # logged in with the cluster key: reachable
    pod = fake.pods[record.nodes[0].instance_id]
    public = (state_dir / "keys" / "rp-t" / "id_ed25519.pub").read_text().strip()
    assert f"SSH_PUBLIC_KEY={public}" in pod["env"] and f"PUBLIC_KEY={account}" in pod["env"]
    assert pod["_keys"] == [public, account]  # both in authorized_keys, as the image installs them
    runpod.BACKEND.down(record, lambda _: None)
    assert account not in fake.ssh.authorized_keys.read_text()


@pytest.mark.parametrize("status", [400, 409])
def test_a_non_2xx_graphql_capacity_error_is_one_line_with_its_message(project, gpuctl, fake, tmp_path, status):
    fake.error_status = status
    write_config(project, provider(fake, tmp_path), name="rp-t")
    real = fake._deploy
    fake._deploy = lambda arg, spot: real({**arg, "minMemoryInGb": 999}, spot)  # gone between search and create
    result = gpuctl("up", "--yes")
    assert result.returncode == 5, result.stderr
    lines = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1
    assert f"RunPod has no capacity right now (HTTP {status}): There are no longer any instances available" in lines[0]
    assert not fake.pods


def test_a_5xx_graphql_error_is_retried_then_named(fake, monkeypatch):
    from provision.providers import http

    monkeypatch.setattr(http, "DEFAULT_RETRY", http.RetryPolicy(attempts=2, first_wait_s=0.01, max_wait_s=0.02))
    fake.error_status = 500
    with pytest.raises(ProviderError) as err:
        runpod.gql(runpod.api(fake.url), runpod.TERMINATE, {"input": {"podId": "nope"}})
    line = err.value.one_line()
    assert "RunPod API kept failing on POST /: HTTP 500: pod not found to terminate (2 tries)" in line


def test_terminate_of_a_gone_pod_answered_non_2xx_is_done(project, fake, tmp_path):
    _cfg, record = up_in_process(project, fake, tmp_path)
    fake.pods.clear()
    fake.error_status = 404
    runpod.BACKEND.down(record, lambda _: None)  # "pod not found to terminate" in a 404: already gone


def test_the_billed_cost_per_hour_replaces_the_estimate_in_cost_and_cap(project, gpuctl, fake, tmp_path):
    fake.price_moves = 0.1  # the per-GPU price rose by $0.10 between search and create
    _cfg, record = up_in_process(project, fake, tmp_path, max_cost=3.0)
    assert record.price_per_hour == pytest.approx(3 * 0.44)  # the pod's costPerHr, not 3 x 0.34
    assert record.budget_hours == pytest.approx(3.0 / (3 * 0.44))
    status = json.loads(gpuctl("status", "--json").stdout)
    assert status["cluster"]["price_per_hour"] == pytest.approx(1.32)
    runpod.BACKEND.down(record, lambda _: None)

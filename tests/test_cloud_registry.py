"""A private provider.image: the registry login reaches the vendor's create call (Vast image_login,
RunPod container registry auth) as the official clients send it, lives as long as the cluster, and
its password is in no output, state file or error message."""

from __future__ import annotations

import pytest
from graphql import GraphQLError
from runpod.api.mutations import container_register_auth as official_auth
from vastai import VastAI

from provision.core.config import load_config
from provision.core.errors import ConfigError, ProviderError
from provision.core.provider_config import REGISTRY_PASSWORD_ENV, RunPodProvider, VastProvider
from provision.core.state import ClusterRecord
from provision.providers import runpod, vast
from provision.providers.base import Offer, UpOptions
from provision.providers.registry_login import registry_login, registry_of
from tests.fakes.harness import assert_secret_absent, node_fields, serve_runpod, serve_vast, write_config
from tests.fakes.oracle import differences

pytestmark = pytest.mark.timeout(240)
IMAGE = "ghcr.io/acme/trainer:1"
PASSWORD = "ghp_registrySecret0123456789"
PRIVATE = {"image": IMAGE, "registry_user": "acme"}


@pytest.fixture
def runpod_fake(sshd, monkeypatch):
    monkeypatch.setenv(REGISTRY_PASSWORD_ENV, PASSWORD)
    yield from serve_runpod(sshd, monkeypatch)


@pytest.fixture
def vast_fake(sshd, monkeypatch):
    monkeypatch.setenv(REGISTRY_PASSWORD_ENV, PASSWORD)
    yield from serve_vast(sshd, monkeypatch)


def config(project, fake, tmp_path, kind: str, **extra):
    write_config(project, {"kind": kind, "api_url": fake.url, **node_fields(tmp_path), **PRIVATE, **extra}, name="reg")
    return load_config(project / "gpuctl.yaml")


@pytest.mark.parametrize(
    ("image", "server"),
    [
        ("ghcr.io/acme/trainer:1", "ghcr.io"),
        ("registry.example:5000/t:1", "registry.example:5000"),
        ("localhost/t", "localhost"),
        ("acme/trainer:1", "docker.io"),
        ("ubuntu", "docker.io"),
    ],
)
def test_the_registry_is_read_from_the_image_as_docker_reads_it(image, server):
    assert registry_of(image) == server


def test_a_registry_user_needs_an_image_and_the_password_its_env(project, tmp_path, monkeypatch):
    write_config(project, {"kind": "vast", "registry_user": "acme"}, name="reg")
    with pytest.raises(ConfigError, match="registry_user is set but provider.image is not"):
        load_config(project / "gpuctl.yaml")
    monkeypatch.delenv(REGISTRY_PASSWORD_ENV, raising=False)
    monkeypatch.setenv("GPUCTL_REGISTRY_USER", "from-env")  # the variables docker.ship pull reads too
    monkeypatch.setenv(REGISTRY_PASSWORD_ENV, PASSWORD)
    login = registry_login(VastProvider(image=IMAGE))
    assert login is not None and (login.server, login.user) == ("ghcr.io", "from-env") and PASSWORD not in repr(login)
    assert registry_login(VastProvider()) is None  # no image of yours: the public bootstrap image, no login
    monkeypatch.delenv("GPUCTL_REGISTRY_USER")
    monkeypatch.delenv(REGISTRY_PASSWORD_ENV)
    for backend, prov in ((vast.BACKEND, VastProvider(**PRIVATE)), (runpod.BACKEND, RunPodProvider(**PRIVATE))):
        with pytest.raises(ConfigError, match=REGISTRY_PASSWORD_ENV):  # before the first rental
            backend.prepare(prov, ClusterRecord(name="reg", provider=prov.kind, nodes=[]), "k")


def test_runpod_login_lives_as_long_as_the_cluster(project, runpod_fake, tmp_path, state_dir):
    from provision.flows import cluster

    cfg = config(project, runpod_fake, tmp_path, "runpod")
    said: list[str] = []
    record = cluster.up(cfg, UpOptions(assume_yes=True, say=said.append))
    ((auth_id, auth),) = runpod_fake.registry_auths.items()
    assert (auth["username"], auth["password"]) == ("acme", PASSWORD) and auth["name"].startswith("gpuctl-reg-")
    assert runpod_fake.deploy_inputs[0]["containerRegistryAuthId"] == auth_id == record.registry_auth_id
    assert runpod_fake.deploy_inputs[0]["imageName"] == IMAGE
    runpod.BACKEND.down(record, said.append)
    assert runpod_fake.registry_auths == {} and not runpod_fake.pods
    assert_secret_absent(PASSWORD, *said, dirs=(state_dir, project))


def test_runpod_up_that_fails_after_the_login_deletes_it(project, gpuctl, runpod_fake, tmp_path, state_dir):
    """The deploy finds no host (uplink): the abort deletes the login it saved, nothing is left."""
    runpod_fake.host_upload_mbps = 10
    config(project, runpod_fake, tmp_path, "runpod", min_upload_mbps=430)
    result = gpuctl("up", "--yes")
    assert result.returncode != 0 and "no longer any instances available" in result.stderr
    assert [op.root for op in runpod_fake.ops].count("saveRegistryAuth") == 1
    assert runpod_fake.registry_auths == {} and not runpod_fake.pods
    assert_secret_absent(PASSWORD, result.stdout, result.stderr, dirs=(state_dir, project))


def test_a_server_that_echoes_the_password_has_it_redacted(runpod_fake, monkeypatch):
    def echo(info, input):
        raise GraphQLError(f"invalid credentials for {input['username']}:{input['password']}")

    monkeypatch.setattr(runpod_fake, "saveRegistryAuth", echo)
    prov = RunPodProvider(api_url=runpod_fake.url, **PRIVATE)
    record = ClusterRecord(name="reg", provider="runpod", nodes=[], api_url=runpod_fake.url)
    with pytest.raises(ProviderError) as caught:
        runpod.BACKEND.prepare(prov, record, "k")
    assert "invalid credentials for acme:***" in str(caught.value) and PASSWORD not in str(caught.value)


def test_vast_image_login_is_what_the_official_client_sends(vast_fake, project, tmp_path, state_dir):
    cfg = config(project, vast_fake, tmp_path, "vast")
    prov = cfg.provider
    official = VastAI(api_key=vast_fake.key, server_url=vast_fake.origin, retry=1)
    cluster = ClusterRecord(name="reg", provider="vast", nodes=[], api_url=vast_fake.url)
    label = "gpuctl-reg-0-abc123"
    start = len(vast_fake.calls)
    official.create_instance(
        id=1001,
        image=IMAGE,
        disk=prov.disk_gb,
        env=vast.create_body(prov, cluster, label)["env"],
        label=label,
        onstart_cmd=vast.ONSTART,
        login=f"-u acme -p {PASSWORD} ghcr.io",  # `vastai create instance --login '-u USER -p PASS SERVER'`
        cancel_unavail=True,
        ssh=True,
        direct=True,
    )
    theirs = vast_fake.calls[start].body
    vast_fake.offers[0]["rented"] = False  # the same offer again, for gpuctl
    start = len(vast_fake.calls)
    vast.BACKEND.launch(
        prov, cluster, label, Offer(id="1001", gpu_name="RTX 4090", num_gpus=3, price_per_hour=1.05), "k"
    )
    ours = vast_fake.calls[start].body
    assert ours["image_login"] == theirs["image_login"] == f"-u acme -p {PASSWORD} ghcr.io"
    assert not differences("create instance", ours, theirs, client="vastai")
    assert_secret_absent(PASSWORD, dirs=(state_dir,))


def test_runpod_save_and_delete_are_what_the_official_client_sends(runpod_fake):
    prov = RunPodProvider(api_url=runpod_fake.url, **PRIVATE)
    record = ClusterRecord(name="reg", provider="runpod", nodes=[], api_url=runpod_fake.url)
    client = runpod.api(runpod_fake.url)
    start = len(runpod_fake.ops)
    client.request("POST", "", {"query": official_auth.generate_container_registry_auth("theirs", "acme", PASSWORD)})
    runpod.BACKEND.prepare(prov, record, "k")
    their_save, our_save = [op for op in runpod_fake.ops[start:] if op.root == "saveRegistryAuth"]
    assert set(our_save.input) == set(their_save.input) == {"name", "username", "password"}
    assert {k: our_save.input[k] for k in ("username", "password")} == {
        k: their_save.input[k] for k in ("username", "password")
    }
    assert our_save.fields <= their_save.fields  # gpuctl selects nothing the client does not
    their_id = next(i for i, a in runpod_fake.registry_auths.items() if a["name"] == "theirs")
    start = len(runpod_fake.ops)
    client.request("POST", "", {"query": official_auth.delete_container_registry_auth(their_id)})
    runpod.BACKEND.release(record, lambda _: None)
    their_delete, our_delete = [op for op in runpod_fake.ops[start:] if op.root == "deleteRegistryAuth"]
    assert set(our_delete.input) == set(their_delete.input) == {"registryAuthId"}
    assert runpod_fake.registry_auths == {} and record.registry_auth_id is None

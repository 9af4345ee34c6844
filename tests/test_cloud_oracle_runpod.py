"""The official RunPod client (PyPI `runpod`, pinned in the test extra) is the oracle: its own
query builders (runpod/api/queries, runpod/api/mutations: values pasted into the query text) run
against the fake RunPod server, a real GraphQL server over RunPod's schema, and what each root
field receives (its input, coerced by the schema, and the fields selected) is compared with what
gpuctl sends for the same intent (values as GraphQL variables).
"""

from __future__ import annotations

import inspect
import re
from importlib.metadata import version
from pathlib import Path

import pytest
import runpod as official
from runpod.api.mutations import pods as official_mutations

from provision.core.errors import NoOfferError
from provision.core.provider_config import RunPodProvider
from provision.core.state import ClusterRecord
from provision.providers import runpod as ours
from provision.providers.base import Offer
from provision.providers.vendor_images import RUNPOD_START, boot_image
from tests.fakes.oracle import differences
from tests.fakes.runpod_api import FakeRunPod

pytestmark = pytest.mark.timeout(120)
KEY_LINE = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOracleOracleOracleOracleOracleOracle000 gpuctl"
GPU = "NVIDIA GeForce RTX 4090"
# What the client's create_pod sends by default that gpuctl leaves out on purpose.
CREATE_DEFAULTS = {
    "minVcpuCount": (1, "the client's default; gpuctl asks for the host by RAM (minMemoryInGb)"),
    "volumeMountPath": ("/runpod-volume", "no volume: volumeInGb is 0"),
    "dataCenterId": (None, "any data center"),
}


@pytest.fixture
def fake(monkeypatch):
    with FakeRunPod() as server:
        monkeypatch.setenv("RUNPOD_API_KEY", server.key)
        monkeypatch.setenv("RUNPOD_API_BASE_URL", server.origin)  # the client posts to {base}/graphql
        monkeypatch.setattr(official, "api_key", server.key)
        yield server


def ops_since(fake, start: int, root: str):
    found = [op for op in fake.ops[start:] if op.root == root]
    assert found, f"no {root} was sent"
    return found


def test_the_pinned_client_is_the_one_installed():
    pin = re.search(r'"runpod==([^"]+)"', (Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert pin and version("runpod") == pin[1], "the test extra pins another runpod than the one installed"


def test_gpu_types_and_lowest_price(fake):
    start = len(fake.ops)
    theirs = official.get_gpu(GPU, 3)
    (their_types,) = ops_since(fake, start, "gpuTypes")
    (their_lowest,) = ops_since(fake, start, "gpuTypes.lowestPrice")
    start = len(fake.ops)
    offers = ours.BACKEND.find_offers(RunPodProvider(api_url=fake.url))
    (our_types,) = ops_since(fake, start, "gpuTypes")
    our_lowest = ops_since(fake, start, "gpuTypes.lowestPrice")
    problems = differences("gpuTypes input", our_types.input, their_types.input, client="runpod")
    for lowest in our_lowest:  # secure and community: the client asks with its gpuCount only
        problems += differences(
            "lowestPrice input",
            lowest.input,
            their_lowest.input,
            client="runpod",
            ours_only={"minMemoryInGb": "host RAM for ZeRO-Offload", "secureCloud": "one price per cloud type"},
        )
    extra = our_types.fields - their_types.fields - {"secure", "community"}
    extra = {f.split(".", 1)[1] if f.startswith(("secure.", "community.")) else f for f in extra}
    documented = {"lowestPrice.stockStatus"}  # in the spec's LowestPrice type, not selected by the client
    problems += [
        f"gpuTypes: field {f}: gpuctl selects it, runpod {version('runpod')} does not"
        for f in extra - their_types.fields - documented
    ]
    assert not problems, "\n".join(problems)
    assert {"lowestPrice.uninterruptablePrice", "lowestPrice.minimumBidPrice"} <= their_types.fields
    # per GPU: for 3 GPUs the lowest price is still the list price of one (secure: the default)
    assert theirs["lowestPrice"]["uninterruptablePrice"] == theirs["securePrice"]
    community = next(o for o in offers if o.id == "COMMUNITY")
    assert community.price_per_hour == pytest.approx(3 * theirs["communityPrice"])


def test_create_pod(fake):
    prov = RunPodProvider(api_url=fake.url, cloud_type="COMMUNITY", min_upload_mbps=430)
    cluster = ClusterRecord(name="oracle", provider="runpod", nodes=[], api_url=fake.url, price_per_hour=1.02)
    label = "gpuctl-oracle-0-abc123"
    env = {"SSH_PUBLIC_KEY": KEY_LINE, "GPUCTL_SSHD": "1", "GPUCTL_CLUSTER": cluster.name}
    start = len(fake.ops)
    official.create_pod(
        name=label,
        image_name=boot_image(prov, "runpod"),  # no provider.image: the pinned PyTorch image, bootstrapped
        gpu_type_id=GPU,
        cloud_type="COMMUNITY",
        support_public_ip=True,
        start_ssh=True,
        gpu_count=prov.gpus_per_node,
        volume_in_gb=0,
        container_disk_in_gb=int(prov.disk_gb),
        min_memory_in_gb=int(prov.min_ram_gb),
        ports="22/tcp",
        env=env,
        allowed_cuda_versions=["12.8", "12.9", "13.0"],  # hosts whose driver runs the image's CUDA 12.8
        min_upload=430,  # Mbit/s: DeepSeek-7B's final checkpoint (96.7 GB) within 30 minutes
    )
    (their_deploy,) = ops_since(fake, start, "podFindAndDeployOnDemand")
    start = len(fake.ops)
    offer = Offer(id="COMMUNITY", gpu_name="RTX 4090", num_gpus=3, price_per_hour=1.02)
    ours.BACKEND.launch(prov, cluster, label, offer, KEY_LINE)
    (our_deploy,) = ops_since(fake, start, "podFindAndDeployOnDemand")
    mine, theirs = dict(our_deploy.input), dict(their_deploy.input)
    # The start command that installs sshd in the PyTorch image (runtime bootstrap): the client pastes
    # docker_args into the query text unescaped, so a multi-line script cannot go through it. The same
    # field (its default ""), sent by gpuctl as a variable.
    assert (mine.pop("dockerArgs"), theirs.pop("dockerArgs")) == (RUNPOD_START, "")
    problems = differences(
        "podFindAndDeployOnDemand",
        {**mine, "env": {e["key"]: e["value"] for e in mine.pop("env")}},
        {**theirs, "env": {e["key"]: e["value"] for e in theirs.pop("env")}},
        client="runpod",
        theirs_only=CREATE_DEFAULTS,
    )
    assert not problems, "\n".join(problems)
    assert their_deploy.input["cloudType"] == our_deploy.input["cloudType"] == "COMMUNITY"  # an enum both ways
    assert our_deploy.input["allowedCudaVersions"] == ["12.8", "12.9", "13.0"] and our_deploy.input["minUpload"] == 430
    assert fake.pods["fakepod000002"]["_keys"] == [KEY_LINE]  # the key reached the pod through SSH_PUBLIC_KEY
    start = len(fake.ops)
    official.get_pod("fakepod000002")
    (their_pod,) = ops_since(fake, start, "pod")
    unknown = our_deploy.fields - their_deploy.fields - their_pod.fields
    assert not unknown, (
        f"podFindAndDeployOnDemand: fields {sorted(unknown)}: gpuctl selects them, the client never does"
    )


def test_get_pod_list_pods_and_terminate(fake):
    cluster = ClusterRecord(name="oracle", provider="runpod", nodes=[], api_url=fake.url)
    pod_input = {"name": "p", "imageName": "i", "cloudType": "ALL", "gpuTypeId": GPU, "gpuCount": 1}
    fake._deploy(pod_input, spot=False)
    fake._deploy(pod_input, spot=False)
    start = len(fake.ops)
    theirs = official.get_pod("fakepod000001")
    ours.BACKEND.describe(cluster, "fakepod000001")
    their_pod, our_pod = ops_since(fake, start, "pod")
    problems = differences("pod input", our_pod.input, their_pod.input, client="runpod")
    documented = {"runtime.uptimeInSeconds"}  # docs' Pod runtime fields; the client does not ask
    problems += [
        f"pod: field {f}: gpuctl selects it, the client does not"
        for f in our_pod.fields - their_pod.fields - documented
    ]
    assert theirs["id"] == "fakepod000001"

    start = len(fake.ops)
    assert [p["id"] for p in official.get_pods()] == [i.id for i in ours.BACKEND.list_instances(cluster)]
    their_list, our_list = ops_since(fake, start, "myself")
    problems += [
        f"myself: field {f}: gpuctl selects it, the client does not"
        for f in our_list.fields - their_list.fields - {f"pods.{d}" for d in documented}
    ]

    start = len(fake.ops)
    official.terminate_pod("fakepod000001")
    ours.BACKEND.terminate(cluster, "fakepod000002")
    their_term, our_term = ops_since(fake, start, "podTerminate")
    problems += differences(
        "podTerminate input",
        {"podId": "X", **{k: v for k, v in our_term.input.items() if k != "podId"}},
        {"podId": "X", **{k: v for k, v in their_term.input.items() if k != "podId"}},
        client="runpod",
    )
    assert set(our_term.input) == set(their_term.input) == {"podId"}
    assert not problems, "\n".join(problems)
    assert not fake.pods


def test_spot_has_no_builder_in_the_client_so_the_spec_is_the_reference(fake):
    """runpod 1.x builds no podRentInterruptable; the fake's schema (RunPod's spec: bidPerGpu
    Float!, same fields as on demand) is what gpuctl's spot create must pass."""
    assert "podRentInterruptable" not in inspect.getsource(official_mutations), "the client builds spot now: compare"
    prov = RunPodProvider(api_url=fake.url, interruptible=True)
    cluster = ClusterRecord(name="oracle", provider="runpod", nodes=[], api_url=fake.url, price_per_hour=0.612)
    offer = Offer(id="COMMUNITY", gpu_name="RTX 4090", num_gpus=3, price_per_hour=0.612, spot=True)
    ours.BACKEND.launch(prov, cluster, "gpuctl-oracle-0-spot00", offer, KEY_LINE)
    (spot,) = ops_since(fake, 0, "podRentInterruptable")
    assert spot.input["bidPerGpu"] == pytest.approx(0.204)
    assert spot.input["allowedCudaVersions"] == ours.allowed_cuda()  # the spec's spot input has it, not minUpload


def test_hosts_without_the_cuda_or_the_uplink_are_not_rented(fake):
    """RunPod places the pod itself: the filters go with the deploy, and no fitting host is an error."""
    cluster = ClusterRecord(name="oracle", provider="runpod", nodes=[], api_url=fake.url)
    offer = Offer(id="COMMUNITY", gpu_name="RTX 4090", num_gpus=3, price_per_hour=1.02)
    for host, prov in (
        ({"host_cuda": "12.4"}, RunPodProvider(api_url=fake.url)),
        ({"host_upload_mbps": 200}, RunPodProvider(api_url=fake.url, min_upload_mbps=430)),
    ):
        for name, value in host.items():
            setattr(fake, name, value)
        with pytest.raises(NoOfferError):
            ours.BACKEND.launch(prov, cluster, "gpuctl-oracle-0-abc123", offer, KEY_LINE)
        fake.host_cuda, fake.host_upload_mbps = "12.8", 1000
    assert not fake.pods

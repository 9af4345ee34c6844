"""Provider `runpod`: RunPod through its GraphQL API (https://api.runpod.io/graphql), with the
roots, input types and fields the official client (PyPI `runpod`, runpod/api/) uses; values go
as GraphQL variables (the client pastes them into the query text), so a name or key is never
parsed as query syntax. tests/test_cloud_oracle_runpod.py compares the two.

- offers: gpuTypes(input: {id}) { lowestPrice(input: {gpuCount, minMemoryInGb, secureCloud}) }
  per cloud type. uninterruptablePrice (on demand) and minimumBidPrice (spot) are per GPU: the
  client selects them beside the per-GPU securePrice/communityPrice (runpod/api/queries/gpus.py,
  generate_gpu_query) and never scales them; the spot input names its bid bidPerGpu (docs
  "Create Spot Pod": bidPerGpu: 0.2, gpuCount: 1) with minimumBidPrice its floor; dstack's
  catalog (gpuhunt) prices a pod as gpu_count x the per-GPU price. So an offer is per GPU x
  gpus_per_node, and once a pod runs its own costPerHr (what RunPod bills the pod, in its pod
  answer) replaces that estimate in the record (cloud.py), so `status` cost and the budget cap
  follow the bill; the cap still counts what the run's earlier clusters spent. A price field
  that is nan, negative or not a number is an error naming it; null or 0 means none offered.
- create: podFindAndDeployOnDemand(input: {name, imageName, gpuTypeId, gpuCount, cloudType,
  containerDiskInGb, volumeInGb, minMemoryInGb, ports: "22/tcp", supportPublicIp, startSsh,
  env: [{key, value}], allowedCudaVersions, minUpload}) -> id; podRentInterruptable(input: {...,
  bidPerGpu}) for spot (its input has no minUpload: spot pods are not filtered on upload). The
  host filters as the client's create_pod sends them: allowedCudaVersions lists RunPod's CUDA
  versions from the image's CUDA up (RunPod places the pod on a host whose driver offers one),
  minUpload the host uplink in Mbit/s (sized_provider: the final checkpoint within
  max_final_upload_min). The pod IS the container; its name is gpuctl's label
  (providers/labels.py). The cluster key goes in env SSH_PUBLIC_KEY, RunPod's documented per-pod key
  (docs: pods/configuration/override-public-keys); RunPod still injects the account's own key
  as PUBLIC_KEY, and gpuctl's image installs both (images/entrypoint.sh, sshd with GPUCTL_SSHD=1).
- ready: pod(input: {podId}) { runtime { ports { ip isIpPublic privatePort publicPort type } } }
  has the public TCP port for 22 (RUNNING is reported while the image still pulls: then an
  SSH banner, cloud.py).
- terminate: podTerminate(input: {podId}); list: myself { pods { ... } }.
- a private provider.image: saveRegistryAuth(input: {name, username, password}) { id } at `up`
  (the client's create_container_registry_auth), the pods deployed with containerRegistryAuthId,
  deleteRegistryAuth(registryAuthId) at `down`. The password is a variable of that one call.
- host: a deploy cannot name or avoid a machine (RunPod places the pod); the pod's `machineId`
  is the host identity it exposes, so recovery.exclude_lost_hosts checks it once the pod runs
  and a pod placed on a lost machine is terminated and asked for again (flows/recover.py).
- errors: a GraphQL reply's errors[] messages, in a 200 or a non-2xx answer, make the one error
  line; "no longer any instances available" (capacity) is a NoOfferError.
Auth: `Authorization: Bearer KEY` (not the `?api_key=` query string, which would put the key in
URLs); key from $RUNPOD_API_KEY or ~/.runpod/config.toml (apikey / api_key).
"""

from __future__ import annotations

import json
import math
import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

from provision.core import state
from provision.core.errors import AuthError, NoOfferError, ProviderError
from provision.core.provider_config import IMAGE_CUDA, CloudProvider, RunPodProvider
from provision.core.state import ClusterRecord, NodeRecord
from provision.core.terminal import scrub
from provision.providers.answers import RunPodGpu, RunPodPod, RunPodPrice, items, listed, obj, read
from provision.providers.base import Offer, SelfTeardown, workdir_env
from provision.providers.cloud import CloudBackend, price_of
from provision.providers.http import ApiRefused, JsonApi, load_key
from provision.providers.instance import Instance
from provision.providers.prices import vendor_price
from provision.providers.registry_login import registry_login
from provision.providers.teardown import http_teardown, node_last
from provision.providers.vendor_images import RUNPOD_START, boot_image

API_URL = "https://api.runpod.io/graphql"
VENDOR = "RunPod"
KEY_ENV = "RUNPOD_API_KEY"
KEY_FILES = [Path("~/.runpod/config.toml")]
FAILED = ("EXITED", "TERMINATED")
# The host CUDA versions RunPod's allowedCudaVersions takes (its API's CudaVersion enum)
CUDA_VERSIONS = ("11.8", "12.0", "12.1", "12.2", "12.3", "12.4", "12.5", "12.6", "12.7", "12.8", "12.9", "13.0")
NO_CAPACITY = re.compile(r"no longer any instances available|not enough|no available|out of stock", re.I)

OFFERS = """query GpuOffers($gpu: GpuTypeFilter, $secure: GpuLowestPriceInput, $community: GpuLowestPriceInput) {
  gpuTypes(input: $gpu) {
    id displayName memoryInGb
    secure: lowestPrice(input: $secure) { minimumBidPrice uninterruptablePrice stockStatus }
    community: lowestPrice(input: $community) { minimumBidPrice uninterruptablePrice stockStatus }
  }
}"""
DEPLOY = """mutation Deploy($input: PodFindAndDeployOnDemandInput!) {
  podFindAndDeployOnDemand(input: $input) { id costPerHr desiredStatus }
}"""
DEPLOY_SPOT = """mutation DeploySpot($input: PodRentInterruptableInput!) {
  podRentInterruptable(input: $input) { id costPerHr desiredStatus }
}"""
POD_FIELDS = "id name desiredStatus costPerHr machineId runtime { uptimeInSeconds ports { ip isIpPublic privatePort publicPort type } }"
POD = f"query Pod($input: PodFilter!) {{ pod(input: $input) {{ {POD_FIELDS} }} }}"
PODS = f"query Pods {{ myself {{ pods {{ {POD_FIELDS} }} }} }}"
POD_CHECK = "query Pod($input: PodFilter!) { pod(input: $input) { id desiredStatus } }"
# A private image: a container registry auth per cluster, named like its pods, made at `up` and
# deleted at `down` (the client's saveRegistryAuth / deleteRegistryAuth; values as variables).
SAVE_AUTH = """mutation SaveRegistryAuth($name: String!, $username: String!, $password: String!) {
  saveRegistryAuth(input: {name: $name, username: $username, password: $password}) { id name } }"""
DELETE_AUTH = "mutation DeleteRegistryAuth($id: String!) { deleteRegistryAuth(registryAuthId: $id) }"
AUTH_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
TERMINATE = "mutation Terminate($input: PodTerminateInput!) { podTerminate(input: $input) }"


def allowed_cuda() -> list[str]:
    """The host CUDA versions that run the image: IMAGE_CUDA and every newer one RunPod names."""
    need = tuple(int(x) for x in IMAGE_CUDA.split("."))
    return [v for v in CUDA_VERSIONS if tuple(int(x) for x in v.split(".")) >= need]


def _parse_config(text: str) -> str:
    match = re.search(r'^\s*api_?key\s*=\s*["\']([^"\']+)["\']', text, re.M | re.I)
    return match[1].strip() if match else ""


def api(api_url: str | None) -> JsonApi:
    key, source = load_key("RunPod", KEY_ENV, KEY_FILES, _parse_config)
    return JsonApi("RunPod", api_url or API_URL, key, source)


def gql(
    client: JsonApi, query: str, variables: dict[str, Any] | None = None, *, idempotent: bool = True
) -> dict[str, Any]:
    try:
        answer = client.request("POST", "", {"query": query, "variables": variables or {}}, idempotent=idempotent)
    except ApiRefused as exc:  # a non-2xx answer: its errors[] say why (capacity, not found, bad query)
        raise _error(exc.detail or f"HTTP {exc.status}", f" (HTTP {exc.status})") from None
    errors = answer.get("errors") if isinstance(answer, dict) else None
    if errors:
        listed = errors if isinstance(errors, list) else [errors]
        text = "; ".join(str(e.get("message", e)) if isinstance(e, dict) else str(e) for e in listed)[:300]
        raise _error(client.redact(scrub(text)))  # an answer may echo what it was sent (a key, a password)
    data = answer.get("data") if isinstance(answer, dict) else None
    return obj(data, VENDOR, "a query")


def _error(text: str, status: str = "") -> ProviderError:
    if NO_CAPACITY.search(text):
        return NoOfferError(
            f"RunPod has no capacity right now{status}: {text}",
            "retry later, or change provider.gpu / cloud_type / min_ram_gb",
        )
    return ProviderError(f"RunPod API error{status}: {text}")


def _instance(raw: object) -> Instance:
    pod = read(RunPodPod, raw, VENDOR, "a pod")
    status = pod.desiredStatus or "PROVISIONING"
    ports = (pod.runtime.ports if pod.runtime else None) or []
    ssh = next((p for p in ports if p.privatePort == 22 and p.isIpPublic and p.type == "tcp" and p.ip), None)
    booting = "RUNNING (image pulling)" if status == "RUNNING" and ssh is None else status
    return Instance(
        id=str(pod.id),
        state=booting,
        ready=status == "RUNNING" and ssh is not None and ssh.publicPort is not None,
        failed=status in FAILED,
        address=ssh.ip if ssh else None,
        port=(ssh.publicPort or 22) if ssh else 22,
        user="root",
        label=pod.name or "",
        host=str(pod.machineId or ""),
        price_per_hour=price_of(pod.costPerHr) or None,  # what RunPod bills the pod; 0 is no price
    )


class RunPodBackend(CloudBackend):
    kind = "runpod"

    def filters_text(self, prov: CloudProvider) -> str:
        assert isinstance(prov, RunPodProvider)
        parts = [
            f"gpuTypeId={prov.gpu}",
            f"gpuCount={prov.gpus_per_node}",
            f"minMemoryInGb={prov.min_ram_gb:g}",
            f"cloudType={prov.cloud_type}",
            f"allowedCudaVersions>={IMAGE_CUDA}",
            ""
            if not prov.min_upload_mbps
            else "no upload filter for spot pods"
            if prov.interruptible
            else f"minUpload={prov.min_upload_mbps:g} Mbit/s",
            "spot" if prov.interruptible else "on-demand",
            f"price<=${prov.max_price}/h per node" if prov.max_price else "",
        ]
        return "(" + ", ".join(p for p in parts if p) + ")"

    def find_offers(self, prov: CloudProvider) -> list[Offer]:
        assert isinstance(prov, RunPodProvider)
        base = {"gpuCount": prov.gpus_per_node, "minMemoryInGb": int(prov.min_ram_gb)}
        data = gql(
            api(prov.api_url),
            OFFERS,
            {
                "gpu": {"id": prov.gpu},
                "secure": {**base, "secureCloud": True},
                "community": {**base, "secureCloud": False},
            },
        )
        offers = []
        for raw in items(data.get("gpuTypes"), VENDOR, "the GPU types"):
            gpu = read(RunPodGpu, raw, VENDOR, "a GPU type")
            for cloud, offered in (("SECURE", gpu.secure), ("COMMUNITY", gpu.community)):
                price = offered or RunPodPrice()
                per_gpu = price.minimumBidPrice if prov.interruptible else price.uninterruptablePrice
                if prov.cloud_type not in ("ALL", cloud) or per_gpu is None or per_gpu == 0:
                    continue  # null (or 0): RunPod has none of it to offer
                field = "minimumBidPrice" if prov.interruptible else "uninterruptablePrice"
                per_gpu = vendor_price(per_gpu, f"RunPod's {field} of {gpu.id!r} ({cloud} cloud)")
                if prov.interruptible and prov.bid_per_gpu:
                    per_gpu = max(prov.bid_per_gpu, per_gpu)
                total = per_gpu * prov.gpus_per_node
                if prov.max_price and total > prov.max_price:
                    continue
                offers.append(
                    Offer(
                        id=cloud,
                        gpu_name=gpu.displayName or gpu.id,
                        num_gpus=prov.gpus_per_node,
                        price_per_hour=round(total, 4),
                        ram_gb=prov.min_ram_gb or None,
                        where=f"{cloud} cloud, ${per_gpu:.3f}/h per GPU, stock {price.stockStatus or '?'}",
                        spot=prov.interruptible,
                    )
                )
        return sorted(offers, key=lambda o: o.price_per_hour)

    def launch(self, prov: CloudProvider, cluster: ClusterRecord, label: str, offer: Offer, public_key: str) -> str:
        assert isinstance(prov, RunPodProvider)
        pod = {
            "name": label,
            "imageName": boot_image(prov, "runpod"),  # provider.image, else the pinned PyTorch image
            "gpuTypeId": prov.gpu,
            "gpuCount": prov.gpus_per_node,
            "cloudType": offer.id,
            "containerDiskInGb": int(prov.disk_gb),
            "volumeInGb": 0,
            "minMemoryInGb": int(prov.min_ram_gb),
            "ports": "22/tcp",
            "supportPublicIp": True,
            "startSsh": True,
            # SSH_PUBLIC_KEY: RunPod's documented per-pod key (its account key still comes as
            # PUBLIC_KEY); gpuctl's entrypoint installs both and starts sshd with GPUCTL_SSHD=1.
            "env": [
                {"key": "SSH_PUBLIC_KEY", "value": public_key},
                {"key": "GPUCTL_SSHD", "value": "1"},
                {"key": "GPUCTL_CLUSTER", "value": cluster.name},
                *({"key": k, "value": v} for k, v in workdir_env(prov).items()),  # the entrypoint's boot hook
            ],
            "allowedCudaVersions": allowed_cuda(),
        }
        if cluster.registry_auth_id:  # a private provider.image (prepare saved the login)
            pod["containerRegistryAuthId"] = cluster.registry_auth_id
        if not prov.image:  # runtime bootstrap: the vendor PyTorch image has no sshd of its own
            pod["dockerArgs"] = RUNPOD_START
        if prov.min_upload_mbps and not prov.interruptible:
            pod["minUpload"] = math.ceil(prov.min_upload_mbps)  # Int, Mbit/s
        if prov.interruptible:
            pod["bidPerGpu"] = round(offer.price_per_hour / prov.gpus_per_node, 4)
            data = gql(api(cluster.api_url), DEPLOY_SPOT, {"input": pod}, idempotent=False).get("podRentInterruptable")
        else:
            data = gql(api(cluster.api_url), DEPLOY, {"input": pod}, idempotent=False).get("podFindAndDeployOnDemand")
        if not data or (isinstance(data, dict) and not data.get("id")):
            raise NoOfferError(
                "RunPod did not deploy a pod (no id returned)", "retry later, or change provider.gpu / cloud_type"
            )
        # (an id that is no id: the abort finds what this deploy made by its name, the label)
        return str(read(RunPodPod, data, VENDOR, "the deploy").id)

    def prepare(self, prov: CloudProvider, cluster: ClusterRecord, public_key: str) -> None:
        """A private provider.image: save the registry login as a RunPod container registry auth."""
        assert isinstance(prov, RunPodProvider)
        login = registry_login(prov)
        if login is None:
            return
        client = api(cluster.api_url)
        client.hide(login.password)
        name = f"gpuctl-{cluster.name}-registry-{secrets.token_hex(3)}"
        variables = {"name": name, "username": login.user, "password": login.password}
        answer = obj(
            gql(client, SAVE_AUTH, variables, idempotent=False).get("saveRegistryAuth"), VENDOR, "the registry auth"
        )
        auth_id = answer.get("id")
        if not isinstance(auth_id, str) or not AUTH_ID.match(auth_id):
            raise ProviderError("RunPod saved the registry login but returned no usable id", "retry `gpuctl up`")
        cluster.registry_auth_id = auth_id
        state.save_cluster(cluster)  # `down` (or the abort of this `up`) deletes it even if this process dies now

    def release(self, cluster: ClusterRecord, say: Callable[[str], None]) -> None:
        """Delete the cluster's container registry auth (once its pods are gone)."""
        if not cluster.registry_auth_id:
            return
        try:
            gql(api(cluster.api_url), DELETE_AUTH, {"id": cluster.registry_auth_id})
        except ProviderError as exc:
            if "not found" not in exc.message.lower():
                raise
        say(f"deleted RunPod registry auth {cluster.registry_auth_id}")
        cluster.registry_auth_id = None

    def account_missing(self) -> str | None:
        try:
            load_key("RunPod", KEY_ENV, KEY_FILES, _parse_config)
        except AuthError as exc:
            return exc.message
        return None

    def describe(self, cluster: ClusterRecord, instance_id: str) -> Instance | None:
        try:
            raw = gql(api(cluster.api_url), POD, {"input": {"podId": instance_id}}).get("pod")
        except ProviderError as exc:
            if "not found" in exc.message.lower():
                return None
            raise
        return _instance(raw) if raw else None

    def terminate(self, cluster: ClusterRecord, instance_id: str) -> None:
        try:
            gql(api(cluster.api_url), TERMINATE, {"input": {"podId": instance_id}})
        except ProviderError:
            if self.describe(cluster, instance_id) is not None:
                raise  # it still exists: the error was real

    def list_instances(self, cluster: ClusterRecord) -> list[Instance]:
        me = obj(gql(api(cluster.api_url), PODS).get("myself"), VENDOR, "the list of pods")
        rows = [listed(p, _instance) for p in items(me.get("pods"), VENDOR, "the list of pods")]
        return [i for i in rows if i is not None]

    def self_teardown(self, cluster: ClusterRecord) -> SelfTeardown | None:
        """The node sends podTerminate for the cluster's pods, its own last."""
        return _teardown(cluster, node_last(cluster))

    def node_teardown(self, cluster: ClusterRecord, node: NodeRecord) -> SelfTeardown | None:
        return _teardown(cluster, [node.instance_id] if node.instance_id else [])


def _teardown(cluster: ClusterRecord, ids: list[str]) -> SelfTeardown | None:
    """podTerminate each pod; the check asks for each pod (the same key, from the node)."""
    if not ids:
        return None
    client = api(cluster.api_url)

    def body(query: str, pod: str) -> str:
        return json.dumps({"query": query, "variables": {"input": {"podId": pod}}})

    calls = [(client.base_url, body(TERMINATE, i)) for i in ids]
    checks = [(client.base_url, body(POD_CHECK, i), i) for i in ids]
    return http_teardown(cluster.python, "POST", calls, client.secret(), check_method="POST", checks=checks)


BACKEND = RunPodBackend()

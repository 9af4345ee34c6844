"""Provider `vast`: Vast.ai through its REST API v0 (docs.vast.ai/api-reference).

- search: POST /bundles/ with a JSON query ({"field": {"op": value}}). Units as the API has
  them: cpu_ram in MB (the vastai CLI multiplies GB by 1000), disk_space in GB, dph_total in $/h
  for the whole offer (all its GPUs, storage included).
- create: PUT /asks/{offer_id}/ {image, disk, runtype: "ssh_direct", label, env, onstart}
  -> {"success": true, "new_contract": instance_id}. The instance IS the container (no Docker
  inside); the image is chosen here. The cluster key is attached with POST /instances/{id}/ssh/.
- ready: GET /instances/{id}/ -> {"instances": {...}}: actual_status "running" and a direct SSH
  port (ports["22/tcp"][0].HostPort on public_ipaddr; else ssh_host:ssh_port, the proxy), then
  an SSH banner (cloud.py).
- terminate: DELETE /instances/{id}/ (404 = already gone); list: GET /instances/.
Auth: `Authorization: Bearer KEY`, key from $VAST_API_KEY or ~/.vast_api_key
(or ~/.config/vastai/vast_api_key, where newer vastai CLIs keep it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from provision.core.config import CloudProvider, VastProvider
from provision.core.errors import ProviderError
from provision.core.state import ClusterRecord
from provision.providers.base import Offer, SelfTeardown
from provision.providers.cloud import CloudBackend, Instance, http_teardown, node_last
from provision.providers.http import ApiNotFound, JsonApi, load_key

API_URL = "https://console.vast.ai/api/v0"
KEY_ENV = "VAST_API_KEY"
KEY_FILES = [Path("~/.vast_api_key"), Path("~/.config/vastai/vast_api_key")]
MB_PER_GB = 1000  # as the vastai CLI converts cpu_ram
SEARCH_LIMIT = 64
# actual_status values that never turn into "running" (docs: show-instance).
FAILED = ("exited", "offline")


def api(api_url: str | None) -> JsonApi:
    key, source = load_key("Vast.ai", KEY_ENV, KEY_FILES)
    return JsonApi("Vast.ai", api_url or API_URL, key, source)


def search_query(prov: VastProvider) -> dict[str, Any]:
    query: dict[str, Any] = {
        "gpu_name": {"eq": prov.gpu},
        "num_gpus": {"eq": prov.gpus_per_node},
        "rentable": {"eq": True},
        "rented": {"eq": False},
        "reliability": {"gte": prov.reliability},
        "cpu_ram": {"gte": round(prov.min_ram_gb * MB_PER_GB)},
        "disk_space": {"gte": prov.disk_gb},
        "direct_port_count": {"gte": 1},  # ssh_direct needs one
        "order": [["dph_total", "asc"]],
        "type": "on-demand",
        "allocated_storage": prov.disk_gb,  # prices include this much storage
        "limit": SEARCH_LIMIT,
    }
    if prov.verified:
        query["verified"] = {"eq": True}
    if prov.max_price:
        query["dph_total"] = {"lte": prov.max_price}
    return query


def _offer(raw: dict[str, Any]) -> Offer:
    return Offer(
        id=str(raw["id"]),
        gpu_name=raw.get("gpu_name", "?"),
        num_gpus=int(raw.get("num_gpus") or 0),
        price_per_hour=float(raw["dph_total"]),
        ram_gb=(raw.get("cpu_ram") or 0) / MB_PER_GB or None,
        disk_gb=raw.get("disk_space"),
        where=raw.get("geolocation") or "",
        reliability=raw.get("reliability", raw.get("reliability2")),
    )


def _instance(raw: dict[str, Any]) -> Instance:
    status = raw.get("actual_status") or "provisioning"
    address, port = None, 22
    mapped = (raw.get("ports") or {}).get("22/tcp") if isinstance(raw.get("ports"), dict) else None
    if mapped and raw.get("public_ipaddr"):
        address, port = raw["public_ipaddr"].strip(), int(mapped[0]["HostPort"])
    elif raw.get("ssh_host") and raw.get("ssh_port"):
        address, port = raw["ssh_host"], int(raw["ssh_port"])
    return Instance(
        id=str(raw["id"]),
        state=status,
        ready=status == "running" and address is not None,
        failed=status in FAILED,
        address=address,
        port=port,
        user="root",
        label=raw.get("label") or "",
    )


class VastBackend(CloudBackend):
    kind = "vast"

    def filters_text(self, prov: CloudProvider) -> str:
        assert isinstance(prov, VastProvider)
        parts = [
            f"gpu_name={prov.gpu}",
            f"num_gpus={prov.gpus_per_node}",
            f"cpu_ram>={prov.min_ram_gb:g} GB",
            f"disk_space>={prov.disk_gb:g} GB",
            f"reliability>={prov.reliability}",
            "rentable",
            "verified" if prov.verified else "",
            f"dph_total<=${prov.max_price}/h" if prov.max_price else "",
        ]
        return "(" + ", ".join(p for p in parts if p) + ")"

    def find_offers(self, prov: CloudProvider) -> list[Offer]:
        assert isinstance(prov, VastProvider)
        answer = api(prov.api_url).request("POST", "/bundles/", search_query(prov)) or {}
        offers = [_offer(o) for o in answer.get("offers") or []]
        return sorted(offers, key=lambda o: o.price_per_hour)

    def picks(self, offers: list[Offer], nodes: int) -> list[Offer]:
        """Each Vast offer is one machine: n nodes take the n cheapest."""
        if len(offers) < nodes:
            raise ProviderError(
                f"only {len(offers)} Vast.ai offer(s) match, {nodes} nodes asked",
                "lower provider.nodes or relax the filters",
            )
        return offers[:nodes]

    def launch(self, prov: CloudProvider, cluster: ClusterRecord, label: str, offer: Offer, public_key: str) -> str:
        assert isinstance(prov, VastProvider)
        client = api(cluster.api_url)
        body = {
            "image": prov.image,
            "disk": prov.disk_gb,
            "runtype": "ssh_direct",
            "label": label,
            "env": {"GPUCTL_CLUSTER": cluster.name},
        }
        answer = client.request("PUT", f"/asks/{offer.id}/", body, idempotent=False) or {}
        if not answer.get("success") or not answer.get("new_contract"):
            raise ProviderError(
                f"Vast.ai did not rent offer {offer.id}: {answer.get('msg') or answer}",
                "the offer may be taken; retry `gpuctl up`",
            )
        instance_id = str(answer["new_contract"])
        try:
            client.request("POST", f"/instances/{instance_id}/ssh/", {"ssh_key": public_key})
        except BaseException:
            client.request("DELETE", f"/instances/{instance_id}/")
            raise
        return instance_id

    def describe(self, cluster: ClusterRecord, instance_id: str) -> Instance | None:
        try:
            answer = api(cluster.api_url).request("GET", f"/instances/{instance_id}/") or {}
        except ApiNotFound:
            return None
        raw = answer.get("instances")
        return _instance(raw) if isinstance(raw, dict) and raw.get("id") is not None else None

    def terminate(self, cluster: ClusterRecord, instance_id: str) -> None:
        try:
            api(cluster.api_url).request("DELETE", f"/instances/{instance_id}/")
        except ApiNotFound:
            pass

    def list_instances(self, cluster: ClusterRecord) -> list[Instance]:
        answer = api(cluster.api_url).request("GET", "/instances/") or {}
        return [_instance(raw) for raw in answer.get("instances") or []]

    def self_teardown(self, cluster: ClusterRecord) -> SelfTeardown | None:
        """The node DELETEs the cluster's instances, its own last."""
        ids = node_last(cluster)
        if not ids:
            return None
        client = api(cluster.api_url)
        calls = [(f"{client.base_url}/instances/{i}/", "") for i in ids]
        return http_teardown(cluster.python, "DELETE", calls, client.secret())


BACKEND = VastBackend()

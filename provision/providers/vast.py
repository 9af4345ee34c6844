"""Provider `vast`: Vast.ai through its REST API, shaped as the official client (PyPI `vastai`,
vastai/api/{offers,instances,keys}.py) sends it; tests/test_cloud_oracle_vast.py compares the two.

- search: POST /api/v0/bundles/ {"field": {"op": value}, order, type, allocated_storage, limit}
  with the client's defaults verified/external=false/rentable/rented. Units as the API has them:
  cpu_ram in MB (the client multiplies GB by 1000), disk_space in GB, dph_total in $/h for the
  whole offer (its GPUs plus `allocated_storage` GB of disk), inet_up in Mbit/s, cuda_max_good the
  driver's CUDA (the client's `cuda_vers>=12.8` is `cuda_max_good: {gte: "12.8"}`). A dph_total or
  min_bid that is nan, 0, negative or not a number is an error naming the field: no cost or cap could hold.
- create: PUT /api/v0/asks/{offer_id}/ {client_id: "me", image, disk, label, env, onstart,
  runtype: "ssh_direc ssh_proxy", cancel_unavail: true} -> {"success": true, "new_contract": id}.
  A private image adds image_login: "-u USER -p PASS SERVER" (the client's `--login`).
  ssh_direc + ssh_proxy: a direct port where the host has one, Vast's proxy always (what the
  client's ssh=True, direct=True builds). cancel_unavail: an offer that cannot be scheduled is
  an error now, not a stopped instance whose disk is billed while we wait for it.
  An SSH runtype replaces the image's entrypoint with Vast's own, so the image's ENV never
  reaches an SSH session: ONSTART (run by Vast's entrypoint, with the container's env) writes
  it to /etc/environment, which PAM reads at every SSH login (Vast's documented pattern).
  The cluster key goes in with POST /api/v0/instances/{id}/ssh/ {"ssh_key": line}, once the id
  is recorded (attach). The label is gpuctl's (providers/labels.py): `gpuctl sweep` finds it.
- ready: GET /api/v0/instances/{id}/?owner=me -> {"instances": {...}}: actual_status "running"
  and an address (ports["22/tcp"][0].HostPort on public_ipaddr, else the proxy ssh_host:ssh_port),
  then an SSH banner (cloud.py). exited/offline/unknown/stopped never turn into running: failed.
- terminate: DELETE /api/v0/instances/{id}/ with body {} (404 = already gone; success false =
  an error); list: GET /api/v1/instances/ paged by next_token, as the client's show_instances.
Auth: `Authorization: Bearer KEY`, key from $VAST_API_KEY, ~/.config/vastai/vast_api_key (the
client's place) or ~/.vast_api_key (older clients').
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import quote_plus

from provision.core.errors import AuthError, ProviderError
from provision.core.provider_config import IMAGE_CUDA, CloudProvider, VastProvider
from provision.core.state import ClusterRecord, NodeRecord
from provision.providers.answers import VastContract, VastInstance, VastOffer, VastPort, items, listed, obj, read
from provision.providers.base import BOOT_HOOK, Offer, SelfTeardown, workdir_env
from provision.providers.cloud import CloudBackend, price_of
from provision.providers.http import ApiNotFound, JsonApi, load_key
from provision.providers.instance import Instance
from provision.providers.prices import vendor_price
from provision.providers.registry_login import registry_login
from provision.providers.teardown import http_teardown, node_last
from provision.providers.vendor_images import boot_image

API_URL = "https://console.vast.ai"
VENDOR = "Vast.ai"
KEY_ENV = "VAST_API_KEY"
KEY_FILES = [Path("~/.config/vastai/vast_api_key"), Path("~/.vast_api_key")]
MB_PER_GB = 1000  # as the client's offers_mult converts cpu_ram
SEARCH_LIMIT = 64
LIST_PAGE = 25  # the client's show_instances page size
LIST_PAGES_MAX = 200  # 5000 instances: a bound on a server that keeps handing out next_token
RUNTYPE = "ssh_direc ssh_proxy"  # sic: the client's resolve_runtype(ssh=True, direct=True)
# actual_status values that never turn into "running" (an exited container, a host gone offline,
# a state Vast cannot tell); intended/cur state "stopped": Vast could not schedule it.
FAILED = ("exited", "offline", "unknown", "stopped")
# Run by Vast's entrypoint at every container start, with the container's environment (the
# image's ENV, NCCL_*, PATH to its venv, GPUCTL_*). It rewrites /etc/environment, which PAM's
# pam_env reads at each SSH login: the container env first, then the file's own other lines.
# Secret-looking names (Vast injects CONTAINER_API_KEY) stay out: the file is world-readable.
ONSTART = r"""# gpuctl: let SSH sessions see the container's environment (Vast's SSH runtype replaced the entrypoint)
new=/etc/environment.gpuctl
env | grep -E '^[A-Za-z_][A-Za-z0-9_]*=' \
  | grep -vE '^(HOME|PWD|OLDPWD|SHLVL|_|HOSTNAME|TERM|SHELL|USER|LOGNAME|MAIL|SSH_[A-Z_]*)=' \
  | grep -viE '^[^=]*(KEY|TOKEN|SECRET|PASSW|CREDENTIAL)[^=]*=' > "$new"
names=$(cut -d= -f1 "$new" | paste -sd'|' -)
grep -vE "^(${names:-^})=" /etc/environment 2>/dev/null >> "$new"
chmod 644 "$new" && mv -f "$new" /etc/environment
"""
# Then a capped node's budget guards start again after a container restart (flows/guard.py).
ONSTART += f"# gpuctl: the budget guards' boot hook\n{BOOT_HOOK}\n"


def api(api_url: str | None) -> JsonApi:
    """The client at Vast's origin; an api_url ending in /api/v0 (older configs) is taken as its origin."""
    key, source = load_key("Vast.ai", KEY_ENV, KEY_FILES)
    base = (api_url or API_URL).rstrip("/").removesuffix("/api/v0")
    return JsonApi("Vast.ai", base, key, source)


def search_query(prov: VastProvider) -> dict[str, Any]:
    query: dict[str, Any] = {
        # the client's defaults (offers.search_offers), then our filters
        "verified": {"eq": True},
        "external": {"eq": False},
        "rentable": {"eq": True},
        "rented": {"eq": False},
        "gpu_name": {"eq": prov.gpu},
        "num_gpus": {"eq": prov.gpus_per_node},
        "reliability": {"gte": prov.reliability},
        "cpu_ram": {"gte": round(prov.min_ram_gb * MB_PER_GB)},
        "disk_space": {"gte": prov.disk_gb},
        "direct_port_count": {"gte": 1},  # ssh_direc needs one (the proxy is the fallback)
        "cuda_max_good": {"gte": float(IMAGE_CUDA)},  # the image's CUDA build runs on this driver or newer
        "order": [["dph_total", "asc"]],
        "type": "bid" if prov.interruptible else "on-demand",  # the client's offer_type "interruptible"
        "allocated_storage": prov.disk_gb,  # prices include this much storage
        "limit": SEARCH_LIMIT,
    }
    if not prov.verified:
        del query["verified"]
    if prov.max_price:
        query["dph_total"] = {"lte": prov.max_price}
    if prov.min_upload_mbps:  # sized_provider: the final checkpoint uploads within max_final_upload_min
        query["inet_up"] = {"gte": prov.min_upload_mbps}
    return query


def create_body(prov: VastProvider, cluster: ClusterRecord, label: str, offer: Offer | None = None) -> dict[str, Any]:
    body = {
        "client_id": "me",
        "image": boot_image(prov, "vast"),  # provider.image, else the pinned PyTorch image (runtime bootstrap)
        "disk": prov.disk_gb,
        "label": label,
        "env": {"GPUCTL_CLUSTER": cluster.name, **workdir_env(prov)},
        "onstart": ONSTART,
        "runtype": RUNTYPE,
        "cancel_unavail": True,
    }
    if prov.interruptible and offer is not None:  # an interruptible instance: the bid, $/h for the machine
        body["price"] = round(offer.price_per_hour, 4)
    return body


def bid_of(prov: VastProvider, raw: VastOffer) -> float:
    """The bid for one bid offer ($/h per machine): bid_per_gpu x its GPUs, else the offer's minimum."""
    if prov.bid_per_gpu:
        return prov.bid_per_gpu * (raw.num_gpus or 0)
    if raw.min_bid in (None, 0):
        return _price(raw, "dph_total")
    return _price(raw, "min_bid")


def _price(raw: VastOffer, field: str) -> float:
    return vendor_price(getattr(raw, field), f"Vast.ai offer {str(raw.id)[:20]}: {field}")


def _offer(raw: object, prov: VastProvider) -> Offer:
    o = read(VastOffer, raw, VENDOR, "an offer")
    dph_total = _price(o, "dph_total")  # checked for a bid offer too: `offers` shows it
    return Offer(
        id=str(o.id),
        gpu_name=o.gpu_name,
        num_gpus=o.num_gpus or 0,
        price_per_hour=bid_of(prov, o) if prov.interruptible else dph_total,
        ram_gb=(o.cpu_ram or 0) / MB_PER_GB or None,
        disk_gb=o.disk_space,
        where=o.geolocation or "",
        reliability=o.reliability if o.reliability is not None else o.reliability2,
        spot=prov.interruptible,
        host=str(o.machine_id or ""),
        download_mbps=o.inet_down if o.inet_down and o.inet_down > 0 else None,
    )


def _instance(raw: object) -> Instance:
    inst = read(VastInstance, raw, VENDOR, "an instance")
    status = inst.actual_status or "provisioning"
    stopped = "stopped" in (inst.intended_status, inst.cur_state)
    address, port = None, 22
    mapped = (inst.ports or {}).get("22/tcp")
    if mapped and inst.public_ipaddr:
        first = items(mapped, VENDOR, f"instance {inst.id}'s ports")[0]
        address, port = (
            inst.public_ipaddr.strip(),
            read(VastPort, first, VENDOR, f"instance {inst.id}'s port 22").HostPort,
        )
    elif inst.ssh_host and inst.ssh_port:
        address, port = inst.ssh_host.strip(), inst.ssh_port
    ready = status == "running" and address is not None and not stopped
    failed = status in FAILED or stopped
    if failed:  # the vendor's word plus its reason, for the one error line
        why = " ".join((inst.status_msg or "").split())[:200]
        status = (status if status in FAILED else "stopped") + (f" ({why})" if why else "")
    return Instance(
        id=str(inst.id),
        state=status,
        ready=ready,
        failed=failed,
        address=address,
        port=port,
        user="root",
        label=inst.label or "",
        price_per_hour=price_of(inst.dph_total),
        detail="" if failed else " ".join((inst.status_msg or "").split())[:200],
    )


def _checked(answer: Any, what: str) -> dict[str, Any]:
    """Vast answers some refusals with HTTP 200 and {"success": false, "msg": ...}."""
    doc = answer if isinstance(answer, dict) else {}
    if doc.get("success") is False:
        detail = doc.get("msg") or doc.get("error") or "success: false"
        raise ProviderError(f"Vast.ai refused to {what}: {str(detail)[:300]}", "check the Vast.ai console")
    return doc


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
            f"cuda_max_good>={IMAGE_CUDA}",
            f"inet_up>={prov.min_upload_mbps:g} Mbit/s" if prov.min_upload_mbps else "",
            "rentable",
            "verified" if prov.verified else "",
            f"dph_total<=${prov.max_price}/h" if prov.max_price else "",
            "interruptible (bid)" if prov.interruptible else "",
        ]
        return "(" + ", ".join(p for p in parts if p) + ")"

    def find_offers(self, prov: CloudProvider) -> list[Offer]:
        assert isinstance(prov, VastProvider)
        answer = obj(api(prov.api_url).request("POST", "/api/v0/bundles/", search_query(prov)), VENDOR, "the search")
        offers = [_offer(o, prov) for o in items(answer.get("offers"), VENDOR, "the search's offers")]
        return sorted(offers, key=lambda o: o.price_per_hour)

    def picks(self, offers: list[Offer], nodes: int) -> list[Offer]:
        """Each Vast offer is one machine: n nodes take the n cheapest."""
        if len(offers) < nodes:
            raise ProviderError(
                f"only {len(offers)} Vast.ai offer(s) match, {nodes} nodes asked",
                "lower provider.nodes or relax the filters",
            )
        return offers[:nodes]

    def prepare(self, prov: CloudProvider, cluster: ClusterRecord, public_key: str) -> None:
        """A private provider.image: its password must be there before the first rental."""
        assert isinstance(prov, VastProvider)
        registry_login(prov)

    def launch(self, prov: CloudProvider, cluster: ClusterRecord, label: str, offer: Offer, public_key: str) -> str:
        assert isinstance(prov, VastProvider)
        client = api(cluster.api_url)
        body = create_body(prov, cluster, label, offer)
        login = registry_login(prov)
        if login:  # a private provider.image: the host's `docker login` arguments
            client.hide(login.password)
            body["image_login"] = login.vast_image_login()
        what = f"the rental of offer {offer.id}"
        answer = obj(client.request("PUT", f"/api/v0/asks/{offer.id}/", body, idempotent=False), VENDOR, what)
        if not answer.get("success") or not answer.get("new_contract"):
            raise ProviderError(
                client.redact(
                    f"Vast.ai did not rent offer {offer.id}: {answer.get('msg') or answer.get('error') or answer}"
                )[:400],
                "the offer may be taken or unschedulable; retry `gpuctl up`",
            )
        # (an id that is no id: the abort finds what this create made by its label)
        return str(read(VastContract, answer, VENDOR, what).new_contract)

    def attach(self, cluster: ClusterRecord, instance_id: str, public_key: str) -> None:
        """The cluster key, once the new instance's id is recorded (a failure here aborts `up`,
        which terminates the instance)."""
        _checked(
            api(cluster.api_url).request("POST", f"/api/v0/instances/{instance_id}/ssh/", {"ssh_key": public_key}),
            f"attach the cluster key to instance {instance_id}",
        )

    def account_missing(self) -> str | None:
        try:
            load_key("Vast.ai", KEY_ENV, KEY_FILES)
        except AuthError as exc:
            return exc.message
        return None

    def describe(self, cluster: ClusterRecord, instance_id: str) -> Instance | None:
        try:
            answer = api(cluster.api_url).request("GET", f"/api/v0/instances/{instance_id}/?owner=me")
        except ApiNotFound:
            return None
        raw = obj(answer, VENDOR, f"the look at instance {instance_id}").get("instances")
        return _instance(raw) if isinstance(raw, dict) and raw.get("id") is not None else None

    def terminate(self, cluster: ClusterRecord, instance_id: str) -> None:
        try:
            answer = api(cluster.api_url).request("DELETE", f"/api/v0/instances/{instance_id}/", {})
        except ApiNotFound:
            return
        _checked(answer, f"destroy instance {instance_id}")

    def list_instances(self, cluster: ClusterRecord) -> list[Instance]:
        """Every instance of the account: the v1 list, paged as the client's show_instances does."""
        client = api(cluster.api_url)
        params: dict[str, Any] = {"select_filters": {}, "order_by": [{"col": "id", "dir": "asc"}], "limit": LIST_PAGE}
        found: list[Instance] = []
        for _page in range(LIST_PAGES_MAX):
            query = "&".join(f"{k}={quote_plus(v if isinstance(v, str) else json.dumps(v))}" for k, v in params.items())
            answer = obj(client.request("GET", f"/api/v1/instances/?{query}"), VENDOR, "the list of instances")
            rows = [listed(raw, _instance) for raw in items(answer.get("instances"), VENDOR, "the list of instances")]
            found += [i for i in rows if i is not None]
            if not answer.get("next_token"):
                return found
            params["after_token"] = answer["next_token"]
        raise ProviderError(f"Vast.ai listed more than {LIST_PAGES_MAX} pages of instances", "check the console")

    def self_teardown(self, cluster: ClusterRecord) -> SelfTeardown | None:
        """The node DELETEs the cluster's instances, its own last."""
        return _teardown(cluster, node_last(cluster))

    def node_teardown(self, cluster: ClusterRecord, node: NodeRecord) -> SelfTeardown | None:
        return _teardown(cluster, [node.instance_id] if node.instance_id else [])


def _teardown(cluster: ClusterRecord, ids: list[str]) -> SelfTeardown | None:
    """DELETE each instance; the check GETs each one (the same key, from the node)."""
    if not ids:
        return None
    client = api(cluster.api_url)
    calls = [(f"{client.base_url}/api/v0/instances/{i}/", "{}") for i in ids]
    checks = [(f"{client.base_url}/api/v0/instances/{i}/?owner=me", "", i) for i in ids]
    return http_teardown(cluster.python, "DELETE", calls, client.secret(), check_method="GET", checks=checks)


BACKEND = VastBackend()

"""A fake Vast.ai REST API, shaped after docs.vast.ai/api-reference and what the official client
(PyPI `vastai`, vastai/api/*.py) sends, so both gpuctl and that client run against it:

- POST /api/v0/bundles/  search: {"field": {"eq"|"neq"|"gt"|"gte"|"lt"|"lte"|"in"|"notin": v}}
  plus order [["field", "asc"|"desc"]], limit, type, allocated_storage -> {"offers": [...]};
  cpu_ram in MB, disk_space in GB, dph_total $/h. Values may come as strings (the client's query
  parser keeps "3" and "0.98" as text): compared as the server does, as numbers. Unknown fields
  or operators -> 400.
- PUT /api/v0/asks/{id}/  {client_id, image, disk, runtype, label, env, onstart, cancel_unavail,
  ...}: image is required (docs: "Yes*", unless a template), env an object, every runtype word a
  known one ("ssh_direc", not "ssh_direct"). -> {"success": true, "new_contract": id}; a
  rented/unknown offer -> 404/410. An offer in `unschedulable`: with cancel_unavail an error,
  without it a *stopped* instance (intended_status "stopped") that never runs.
- POST /api/v0/instances/{id}/ssh/ {"ssh_key": line} -> {"success": true}
- GET /api/v1/instances/?select_filters&order_by&limit[&after_token] -> {"instances": [...],
  "next_token": ...} paged; GET /api/v0/instances/{id}/[?owner=me] -> {"instances": {...}}:
  actual_status goes null -> "loading" (status_msg: the pull's progress, PULL_MSG) -> "running"
  over `boot_polls` reads, then ports
  {"22/tcp": [{"HostIp", "HostPort"}]} on public_ipaddr point at the test sshd; extra_env is a
  list of [name, value] pairs (the client turns it into a dict).
- DELETE /api/v0/instances/{id}/ -> {"success": true}; unknown -> 404; an id in `refuse_delete`
  -> 200 {"success": false, "msg": ...} and the instance stays.
Auth: Authorization: Bearer KEY (or ?api_key=KEY); else 401.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from dataclasses import dataclass, field

from tests.fakes.base import ApiError, FakeApi

PULL_MSG = "Pulling image: 3 of 12 layers"  # what a loading instance's status_msg says (the image pull)
CONTROL = {"order", "limit", "type", "allocated_storage", "disable_bundling"}
OPS = {
    "eq": lambda a, b: a == b,
    "neq": lambda a, b: a != b,
    "gt": lambda a, b: a > b,
    "gte": lambda a, b: a >= b,
    "lt": lambda a, b: a < b,
    "lte": lambda a, b: a <= b,
    "in": lambda a, b: a in b,
    "notin": lambda a, b: a not in b,
}
# every field the official client's build_create_instance_payload can send
CREATE_FIELDS = {
    "client_id",
    "image",
    "template_hash_id",
    "label",
    "disk",
    "runtype",
    "target_state",
    "price",
    "env",
    "onstart",
    "args",
    "args_str",
    "extra",
    "image_login",
    "python_utf8",
    "lang_utf8",
    "use_jupyter_lab",
    "jupyter_dir",
    "force",
    "cancel_unavail",
    "user",
    "volume_info",
}
RUNTYPE_WORDS = {"ssh", "jupyter", "args", "ssh_proxy", "ssh_direc", "jupyter_proxy", "jupyter_direc"}


def offer(
    id: int,
    *,
    gpu="RTX 4090",
    n=3,
    ram_mb=257_000,
    disk=500.0,
    price=1.05,
    reliability=0.995,
    verified=True,
    rentable=True,
    external=False,
    where="Fakeland, FK",
    cuda=12.8,
    inet_up=800.0,
) -> dict:
    return {
        "id": id,
        "ask_contract_id": id,
        "machine_id": id + 50_000,
        "gpu_name": gpu,
        "num_gpus": n,
        "cpu_ram": ram_mb,
        "cpu_cores": 64,
        "disk_space": disk,
        "dph_total": price,
        "dph_base": price * 0.9,
        "min_bid": round(price * 0.4, 4),  # an interruptible (type "bid") rental's lowest bid, $/h
        "reliability": reliability,
        "verified": verified,
        "rentable": rentable,
        "rented": False,
        "direct_port_count": 40,
        "geolocation": where,
        "inet_down": 900.0,
        "inet_up": inet_up,
        "gpu_ram": 24564,
        "cuda_max_good": cuda,
        "external": external,
        "score": 100.0 - price,
    }


def default_offers() -> list[dict]:
    """Two that match the defaults (3 x RTX 4090, >= 128 GB RAM, reliable, verified, a driver for CUDA 12.8,
    a working uplink) and decoys."""
    return [
        offer(1001, price=1.05),
        offer(1002, price=0.55, ram_mb=64_000),  # too little RAM (64 GB)
        offer(1003, price=1.45, ram_mb=515_000, where="Elsewhere, EL"),
        offer(1004, price=0.35, n=1),  # one GPU
        offer(1005, price=0.75, gpu="RTX 3090"),
        offer(1006, price=0.80, reliability=0.90),
        offer(1007, price=0.70, verified=False),
        offer(1008, price=0.65, external=True),  # an external listing: the client hides it
        offer(1009, price=0.45, cuda=12.4),  # a driver too old for the image's CUDA 12.8
        offer(1010, price=1.50, inet_up=0.8),  # an uplink that would take days for any checkpoint
    ]


def _number(value):
    """The server compares "3" with 3 and "0.98" with 0.98; the client sends either."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    if isinstance(value, list):
        return [_number(v) for v in value]
    return value


def _bad(msg: str, status: int = 400) -> ApiError:
    return ApiError(status, {"success": False, "error": "invalid_args", "msg": msg})


@dataclass
class FakeVast(FakeApi):
    offers: list[dict] = field(default_factory=default_offers)
    instances: dict[int, dict] = field(default_factory=dict)
    deleted: list[int] = field(default_factory=list)
    created_bodies: list[dict] = field(default_factory=list)
    boot_polls: int = 2  # reads of an instance before it reports "running"
    lose_create_answer: bool = False  # create the instance, then answer 502 (a lost response)
    addresses: tuple[str, ...] = ("127.0.0.1",)  # a new instance answers on the first one no live one uses
    unschedulable: set[int] = field(default_factory=set)  # offer ids whose machine cannot start it
    refuse_delete: set[int] = field(default_factory=set)  # instance ids whose DELETE says success false

    def __post_init__(self):
        super().__post_init__()
        self._ids = itertools.count(7_000_001)

    @property
    def url(self) -> str:
        return self.origin

    def handle(self, method: str, path: str, body, query: dict) -> tuple[int, dict]:
        if method == "GET" and path == "/api/v1/instances/":
            return 200, self._list(query)
        route = path.removeprefix("/api/v0")
        if method == "POST" and route == "/bundles/":
            return 200, {"offers": self._search(body or {})}
        if (m := re.fullmatch(r"/asks/(\d+)/", route)) and method == "PUT":
            return self._create(int(m[1]), body or {})
        if (m := re.fullmatch(r"/instances/(\d+)/ssh/", route)) and method == "POST":
            inst = self._get(int(m[1]))
            key = (body or {}).get("ssh_key", "")
            if not key.startswith("ssh-"):
                raise _bad("ssh_key is not a public key")
            inst["_keys"].append(key)
            if self.ssh:
                self.ssh.add_key(key)
            return 200, {"success": True}
        if (m := re.fullmatch(r"/instances/(\d+)/", route)) and method == "GET":
            return 200, {"instances": self._view(self._get(int(m[1])))}
        if (m := re.fullmatch(r"/instances/(\d+)/", route)) and method == "DELETE":
            return 200, self._delete(self._get(int(m[1])))
        raise ApiError(404, {"success": False, "error": "not_found", "msg": f"no route {method} {path}"})

    # search ------------------------------------------------------------------------------------
    def _search(self, query: dict) -> list[dict]:
        rows = [o for o in self.offers if not o["rented"]]  # a rented ask is gone from every search
        for name, cond in query.items():
            if name in CONTROL:
                continue
            if name not in self.offers[0]:
                raise _bad(f"unknown field {name}")
            if not isinstance(cond, dict) or not set(cond) <= set(OPS):
                raise _bad(f"bad condition for {name}")
            for op, value in cond.items():
                rows = [o for o in rows if OPS[op](o[name], _number(value))]
        for name, direction in reversed(query.get("order") or []):
            rows.sort(key=lambda o: o[name], reverse=direction == "desc")
        return rows[: int(query.get("limit") or 64)]

    # instances ---------------------------------------------------------------------------------
    def _create(self, offer_id: int, body: dict) -> tuple[int, dict]:
        unknown = set(body) - CREATE_FIELDS
        if unknown:
            raise _bad(f"unknown create fields {sorted(unknown)}")
        if not body.get("image") and not body.get("template_hash_id"):
            raise _bad("image is required")
        words = str(body.get("runtype") or "ssh").split()
        if not words or not set(words) <= RUNTYPE_WORDS:
            raise _bad(f"invalid runtype {body.get('runtype')!r}")
        if not isinstance(body.get("env", {}), dict):
            raise _bad("env must be an object")
        ask = next((o for o in self.offers if o["id"] == offer_id), None)
        if ask is None:
            raise ApiError(
                404, {"success": False, "error": "no_such_ask", "msg": "Offer not found", "ask_id": offer_id}
            )
        if ask["rented"]:
            raise ApiError(410, {"success": False, "error": "no_such_ask", "msg": "Offer no longer available"})
        if body.get("price") is not None and float(body["price"]) < ask["min_bid"]:
            raise _bad(f"bid ${body['price']}/h is below this offer's minimum ${ask['min_bid']}/h")
        stuck = offer_id in self.unschedulable
        if stuck and body.get("cancel_unavail"):
            raise ApiError(400, {"success": False, "error": "unavailable", "msg": "Required resources unavailable"})
        ask["rented"] = True
        self.created_bodies.append(body)
        instance_id = next(self._ids)
        self.instances[instance_id] = {
            "id": instance_id,
            "ask": ask,
            "label": body.get("label"),
            "image_uuid": body["image"],
            "image_runtype": body.get("runtype", "ssh"),
            "extra_env": body.get("env", {}),
            "onstart": body.get("onstart"),
            "disk_space": body.get("disk", 8),
            "start_date": time.time(),
            "_stuck": stuck,
            "_address": self._free_address(),
            "_reads": 0,
            "_keys": [],
        }
        if self.lose_create_answer:
            raise ApiError(502, {"detail": "Bad Gateway"})
        return 200, {"success": True, "new_contract": instance_id}

    def _free_address(self) -> str:
        used = {i["_address"] for i in self.instances.values() if not i.get("_preempted")}
        return next(
            (a for a in self.addresses if a not in used), self.addresses[len(self.instances) % len(self.addresses)]
        )

    def _drop_keys(self, inst: dict) -> None:
        """The instance's keys stop letting anyone in. The stand-in's instances share one sshd (and
        a cluster shares one key): a key another live instance holds stays for that one."""
        held = {k for i in self.instances.values() if i is not inst and not i.get("_preempted") for k in i["_keys"]}
        for key in inst["_keys"]:
            if self.ssh and key not in held:
                self.ssh.remove_key(key)

    def _delete(self, inst: dict) -> dict:
        if inst["id"] in self.refuse_delete:
            return {"success": False, "error": "delete_failed", "msg": "Instance is locked by an ongoing operation"}
        self._drop_keys(inst)
        del self.instances[inst["id"]]
        inst["ask"]["rented"] = False
        self.deleted.append(inst["id"])
        return {"success": True}

    def _list(self, query: dict) -> dict:
        try:
            limit = int(json.loads(query.get("limit", "25")))
            after = int(query.get("after_token") or 0)
        except ValueError:
            raise _bad("bad limit or after_token") from None
        rows = sorted(self.instances.values(), key=lambda i: i["id"])
        rows = [i for i in rows if i["id"] > after][:limit]
        more = len(rows) == limit and any(i["id"] > rows[-1]["id"] for i in self.instances.values())
        return {
            "instances": [self._view(i, count=False) for i in rows],
            "next_token": str(rows[-1]["id"]) if more else None,
            "total_instances": len(self.instances),
        }

    def _get(self, instance_id: int) -> dict:
        inst = self.instances.get(instance_id)
        if inst is None:
            raise ApiError(404, {"success": False, "error": "no_such_instance", "msg": "Instance not found"})
        return inst

    def preempt(self, instance_id: int) -> None:
        """Take the machine back mid-run (outbid, host gone): the instance reports exited and its
        SSH stops letting anyone in. (The test kills what ran on it: the stand-in is this machine.)"""
        with self.lock:
            inst = self.instances[instance_id]
            inst["_preempted"] = True
            self._drop_keys(inst)

    def _view(self, inst: dict, count: bool = True) -> dict:
        if count:
            inst["_reads"] += 1
        ask = inst["ask"]
        reads = inst["_reads"]
        status = None if reads <= 1 else "running" if reads > self.boot_polls else "loading"
        if inst["_stuck"] or inst.get("_preempted"):
            status = "exited" if reads > 1 else None
        running = status == "running" and self.ssh is not None
        return {
            "id": inst["id"],
            "actual_status": status,
            "intended_status": "stopped" if inst["_stuck"] else "running",
            "cur_state": "stopped" if inst["_stuck"] else "running",
            "status_msg": "Unable to schedule: required resources unavailable"
            if inst["_stuck"]
            else "preempted: outbid"
            if inst.get("_preempted")
            else PULL_MSG
            if status == "loading"
            else None,
            "label": inst["label"],
            "image_uuid": inst["image_uuid"],
            "image_runtype": inst["image_runtype"],
            "extra_env": [[k, v] for k, v in inst["extra_env"].items()],
            "onstart": inst["onstart"],
            "machine_id": ask["machine_id"],
            "gpu_name": ask["gpu_name"],
            "num_gpus": ask["num_gpus"],
            "cpu_ram": ask["cpu_ram"],
            "disk_space": inst["disk_space"],
            "dph_total": ask["dph_total"],
            "start_date": inst["start_date"],
            "public_ipaddr": inst["_address"] if running else None,
            "ports": {"22/tcp": [{"HostIp": "0.0.0.0", "HostPort": str(self.ssh.port)}]} if running else {},
            "ssh_host": "ssh5.fake.vast.ai",
            "ssh_port": 20000 + inst["id"] % 10000,
            "direct_port_count": ask["direct_port_count"],
        }

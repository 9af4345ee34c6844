"""A fake Vast.ai REST API v0, shaped after docs.vast.ai/api-reference:

- POST /api/v0/bundles/  search: {"field": {"eq"|"neq"|"gt"|"gte"|"lt"|"lte"|"in"|"notin": v}}
  plus order [["field", "asc"|"desc"]], limit, type, allocated_storage -> {"offers": [...]};
  cpu_ram in MB, disk_space in GB, dph_total $/h. Unknown fields or operators -> 400.
- PUT /api/v0/asks/{id}/  {image, disk, runtype, label, env, onstart, ...}
  -> {"success": true, "new_contract": instance_id}; a rented/unknown offer -> 404/410.
- POST /api/v0/instances/{id}/ssh/ {"ssh_key": line} -> {"success": true}
- GET /api/v0/instances/ -> {"instances_found": n, "instances": [...]}
- GET /api/v0/instances/{id}/ -> {"instances": {...}}; actual_status goes null -> "loading" ->
  "running" over `boot_polls` reads, then ports {"22/tcp": [{"HostIp", "HostPort"}]} on
  public_ipaddr point at the test sshd.
- DELETE /api/v0/instances/{id}/ -> {"success": true}; unknown -> 404.
Auth: Authorization: Bearer KEY (or ?api_key=KEY); else 401.
"""

from __future__ import annotations

import itertools
import re
import time
from dataclasses import dataclass, field

from tests.fakes.base import ApiError, FakeApi

CONTROL = {"order", "limit", "type", "allocated_storage", "disable_bundling", "external"}
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
CREATE_FIELDS = {
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
    "image_login",
    "cancel_unavail",
    "client_id",
}
RUNTYPES = {"ssh", "jupyter", "args", "ssh_proxy", "ssh_direct", "jupyter_proxy", "jupyter_direct"}


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
    where="Fakeland, FK",
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
        "reliability": reliability,
        "verified": verified,
        "rentable": rentable,
        "rented": False,
        "direct_port_count": 40,
        "geolocation": where,
        "inet_down": 900.0,
        "inet_up": 800.0,
        "gpu_ram": 24564,
        "cuda_max_good": 12.4,
        "external": False,
    }


def default_offers() -> list[dict]:
    """Two that match the defaults (3 x RTX 4090, >= 128 GB RAM, reliable, verified) and decoys."""
    return [
        offer(1001, price=1.05),
        offer(1002, price=0.55, ram_mb=64_000),  # too little RAM (64 GB)
        offer(1003, price=1.45, ram_mb=515_000, where="Elsewhere, EL"),
        offer(1004, price=0.35, n=1),  # one GPU
        offer(1005, price=0.75, gpu="RTX 3090"),
        offer(1006, price=0.80, reliability=0.90),
        offer(1007, price=0.70, verified=False),
    ]


@dataclass
class FakeVast(FakeApi):
    offers: list[dict] = field(default_factory=default_offers)
    instances: dict[int, dict] = field(default_factory=dict)
    deleted: list[int] = field(default_factory=list)
    created_bodies: list[dict] = field(default_factory=list)
    boot_polls: int = 2  # reads of an instance before it reports "running"
    lose_create_answer: bool = False  # create the instance, then answer 502 (a lost response)
    addresses: tuple[str, ...] = ("127.0.0.1",)  # instance n answers on addresses[n % len]: two "hosts"

    def __post_init__(self):
        super().__post_init__()
        self._ids = itertools.count(7_000_001)

    @property
    def url(self) -> str:
        return f"{self.origin}/api/v0"

    def handle(self, method: str, path: str, body, query: dict) -> tuple[int, dict]:
        route = path.removeprefix("/api/v0")
        if method == "POST" and route == "/bundles/":
            return 200, {"offers": self._search(body or {})}
        if (m := re.fullmatch(r"/asks/(\d+)/", route)) and method == "PUT":
            return self._create(int(m[1]), body or {})
        if (m := re.fullmatch(r"/instances/(\d+)/ssh/", route)) and method == "POST":
            inst = self._get(int(m[1]))
            key = (body or {}).get("ssh_key", "")
            if not key.startswith("ssh-"):
                raise ApiError(400, {"success": False, "error": "invalid_args", "msg": "ssh_key is not a public key"})
            inst["_keys"].append(key)
            if self.ssh:
                self.ssh.add_key(key)
            return 200, {"success": True}
        if route == "/instances/" and method == "GET":
            found = [self._view(i) for i in self.instances.values()]
            return 200, {"instances_found": len(found), "instances": found}
        if (m := re.fullmatch(r"/instances/(\d+)/", route)) and method == "GET":
            return 200, {"instances": self._view(self._get(int(m[1])))}
        if (m := re.fullmatch(r"/instances/(\d+)/", route)) and method == "DELETE":
            inst = self._get(int(m[1]))
            for key in inst["_keys"]:
                if self.ssh:
                    self.ssh.remove_key(key)
            del self.instances[inst["id"]]
            inst["ask"]["rented"] = False
            self.deleted.append(inst["id"])
            return 200, {"success": True}
        raise ApiError(404, {"success": False, "error": "not_found", "msg": f"no route {method} {path}"})

    # search ------------------------------------------------------------------------------------
    def _search(self, query: dict) -> list[dict]:
        rows = [o for o in self.offers if o["rentable"] and not o["rented"]]
        for name, cond in query.items():
            if name in CONTROL:
                continue
            if name not in self.offers[0]:
                raise ApiError(400, {"success": False, "error": "invalid_args", "msg": f"unknown field {name}"})
            if not isinstance(cond, dict) or not set(cond) <= set(OPS):
                raise ApiError(400, {"success": False, "error": "invalid_args", "msg": f"bad condition for {name}"})
            for op, value in cond.items():
                rows = [o for o in rows if OPS[op](o[name], value)]
        for name, direction in reversed(query.get("order") or []):
            rows.sort(key=lambda o: o[name], reverse=direction == "desc")
        return rows[: int(query.get("limit") or 64)]

    # instances ---------------------------------------------------------------------------------
    def _create(self, offer_id: int, body: dict) -> tuple[int, dict]:
        unknown = set(body) - CREATE_FIELDS
        if unknown or not body.get("image") or body.get("runtype", "ssh") not in RUNTYPES:
            raise ApiError(
                400, {"success": False, "error": "invalid_args", "msg": f"bad create body {sorted(unknown)}"}
            )
        if not isinstance(body.get("env", {}), dict):
            raise ApiError(400, {"success": False, "error": "invalid_args", "msg": "env must be an object"})
        ask = next((o for o in self.offers if o["id"] == offer_id), None)
        if ask is None:
            raise ApiError(
                404, {"success": False, "error": "no_such_ask", "msg": "Offer not found", "ask_id": offer_id}
            )
        if ask["rented"]:
            raise ApiError(410, {"success": False, "error": "no_such_ask", "msg": "Offer no longer available"})
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
            "_reads": 0,
            "_keys": [],
        }
        if self.lose_create_answer:
            raise ApiError(502, {"detail": "Bad Gateway"})
        return 200, {"success": True, "new_contract": instance_id}

    def _get(self, instance_id: int) -> dict:
        inst = self.instances.get(instance_id)
        if inst is None:
            raise ApiError(404, {"success": False, "error": "no_such_instance", "msg": "Instance not found"})
        return inst

    def _view(self, inst: dict) -> dict:
        inst["_reads"] += 1
        ask = inst["ask"]
        status = None if inst["_reads"] == 1 else "running" if inst["_reads"] > self.boot_polls else "loading"
        running = status == "running" and self.ssh is not None
        return {
            "id": inst["id"],
            "actual_status": status,
            "intended_status": "running",
            "cur_state": "running",
            "label": inst["label"],
            "image_uuid": inst["image_uuid"],
            "image_runtype": inst["image_runtype"],
            "extra_env": inst["extra_env"],
            "onstart": inst["onstart"],
            "machine_id": ask["machine_id"],
            "gpu_name": ask["gpu_name"],
            "num_gpus": ask["num_gpus"],
            "cpu_ram": ask["cpu_ram"],
            "disk_space": inst["disk_space"],
            "dph_total": ask["dph_total"],
            "start_date": inst["start_date"],
            "public_ipaddr": self.addresses[(inst["id"] - 7_000_001) % len(self.addresses)] if running else None,
            "ports": {"22/tcp": [{"HostIp": "0.0.0.0", "HostPort": str(self.ssh.port)}]} if running else {},
            "ssh_host": "ssh5.fake.vast.ai",
            "ssh_port": 20000 + inst["id"] % 10000,
            "direct_port_count": ask["direct_port_count"],
        }

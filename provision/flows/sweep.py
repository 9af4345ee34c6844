"""`gpuctl sweep`: paid instances that carry gpuctl's label (providers/labels.py) but that no
cluster record owns, on every vendor account this machine is configured for.

Where they come from: an `up` killed by SIGKILL (its intent is recorded: `down` or this finds
it), a state dir that was deleted or moved, a cluster record someone deleted by hand, an older
gpuctl. An account is a vendor with credentials here (Vast.ai and RunPod: an API key; AWS:
boto3's credentials and a region) at each endpoint the config or a cluster record names (the
vendor's own when none does). What is left alone: instances a record lists (by id or by the
label it recorded), those of a cluster whose `up` or `down` is running now (its lock is held),
and those of a cluster whose record is damaged. A record whose `up` was stopped before it
finished (still `creating`, no `up` running) is taken down as `gpuctl down` would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from provision.core import state
from provision.core.config import GpuctlConfig
from provision.core.errors import GpuctlError
from provision.core.state import ClusterRecord
from provision.providers import backend
from provision.providers.cloud import CloudBackend
from provision.providers.instance import Instance
from provision.providers.labels import cluster_of

KINDS = ("vast", "runpod", "aws")


@dataclass
class Stray:
    kind: str
    account: ClusterRecord  # where to terminate it: api_url, region; named after the label's cluster
    instance: Instance
    why: str  # "no record" | "not in cluster X's record" | "interrupted `up`"
    owner: str | None = None  # an interrupted `up`'s cluster: `down` of it removes the instance

    def to_json(self) -> dict[str, Any]:
        return {
            "provider": self.kind,
            "instance": self.instance.id,
            "cluster": self.account.name,
            "label": self.instance.label,
            "state": self.instance.state,
            "price_per_hour": self.instance.price_per_hour,
            "why": self.why,
            "endpoint": self.account.api_url or self.account.region,
        }


@dataclass
class Sweep:
    strays: list[Stray] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)  # the accounts looked at
    skipped: list[str] = field(default_factory=list)  # a vendor not configured, an instance left alone
    errors: list[str] = field(default_factory=list)  # an account that could not be listed, a failed terminate

    @property
    def price_per_hour(self) -> float:
        return sum(s.instance.price_per_hour or 0.0 for s in self.strays)


def find(cfg: GpuctlConfig | None, kinds: list[str] | None = None) -> Sweep:
    """Every stray on every configured account (cfg: the project's config, for its endpoint)."""
    records, damaged = state.scan_clusters()
    result = Sweep(skipped=[f"cluster {name}: its record is damaged; its instances are left alone" for name in damaged])
    for kind in KINDS:
        if kinds and kind not in kinds:
            continue
        provider = backend(kind)
        assert isinstance(provider, CloudBackend)
        missing = provider.account_missing()
        if missing:
            result.skipped.append(f"{kind}: not configured here ({missing})")
            continue
        accounts = _accounts(provider, cfg, records)
        if not accounts:
            result.skipped.append(f"{kind}: no region configured (provider.region, AWS_DEFAULT_REGION)")
        for account in accounts:
            where = f"{kind} ({account.api_url or account.region or 'default endpoint'})"
            try:
                listed = provider.list_ours(account)
            except GpuctlError as exc:
                result.errors.append(f"{where}: {exc.one_line()}")
                continue
            result.checked.append(where)
            for inst in listed:
                _classify(result, kind, account, inst, records, set(damaged))
    owners = {s.owner for s in result.strays}
    for r in records:  # an intent with nothing created (or all of it gone): free, but still recorded
        if (
            r.creating
            and r.name not in owners
            and (not kinds or r.provider in kinds)
            and not state.cluster_busy(r.name)
        ):
            result.skipped.append(
                f"cluster {r.name}: an `up` stopped before {r.provider} listed anything of it; "
                f"`gpuctl down --cluster {r.name}` forgets it"
            )
    return result


def _accounts(provider: CloudBackend, cfg: GpuctlConfig | None, records: list[ClusterRecord]) -> list[ClusterRecord]:
    """The endpoints of the vendor the config and the records name; else its default one."""
    kind = provider.kind
    endpoints = {(r.api_url, r.region) for r in records if r.provider == kind}
    if cfg is not None and cfg.provider.kind == kind:
        endpoints.add((getattr(cfg.provider, "api_url", None), getattr(cfg.provider, "region", None)))
    if not endpoints:
        default = provider.default_account()
        return [default] if default is not None else []
    return [
        ClusterRecord(name="sweep", provider=kind, nodes=[], api_url=url, region=region)
        for url, region in sorted(endpoints, key=str)
    ]


def _classify(
    result: Sweep, kind: str, account: ClusterRecord, inst: Instance, records: list[ClusterRecord], damaged: set[str]
) -> None:
    name = cluster_of(inst.label)
    assert name is not None  # list_ours returns labelled instances only
    owner = next(
        (
            r
            for r in records
            if r.provider == kind and any(inst.id == n.instance_id or inst.label == n.label for n in r.nodes)
        ),
        None,
    )
    if owner is not None and not owner.creating:
        return  # a cluster that is up owns it
    if name in damaged:
        return  # said once for the cluster (find)
    if state.cluster_busy(owner.name if owner else name):
        result.skipped.append(f"{kind} instance {inst.id}: an `up` or `down` of cluster {name} is running; left alone")
        return
    if owner is not None:
        why = "interrupted `up`"
    elif any(r.name == name for r in records):
        why = f"not in cluster {name}'s record"
    else:
        why = "no record"
    target = account.model_copy(update={"name": name})  # AWS lists and releases by the cluster's name
    result.strays.append(Stray(kind, target, inst, why, owner.name if owner else None))


def terminate(sweep: Sweep, say: Callable[[str], None]) -> list[str]:
    """Terminate every stray, verified gone as `down` does; the ids terminated. A failure is added
    to sweep.errors and the others still go."""
    from provision.flows import cluster as cluster_flow

    done: list[str] = []
    for owner in sorted({s.owner for s in sweep.strays if s.owner}):
        try:
            cluster_flow.down(owner, say)
            done += [s.instance.id for s in sweep.strays if s.owner == owner]
        except GpuctlError as exc:
            sweep.errors.append(f"cluster {owner}: {exc.one_line()}")
    groups: dict[tuple[str, str | None, str | None, str, str], list[Stray]] = {}
    for s in sweep.strays:
        if not s.owner:
            key = (s.kind, s.account.api_url, s.account.region, s.account.name, s.why)
            groups.setdefault(key, []).append(s)
    for group in groups.values():
        kind, account, ids = group[0].kind, group[0].account, [s.instance.id for s in group]
        provider = backend(kind)
        assert isinstance(provider, CloudBackend)
        try:
            for instance_id in ids:
                provider.terminate(account, instance_id)
            provider.wait_gone(account, ids)
            if group[0].why == "no record":  # AWS: the cluster's security group and key pair, unused now
                provider.release(account, say)
        except GpuctlError as exc:
            sweep.errors.append(f"{kind} instance(s) {', '.join(ids)}: {exc.one_line()}")
            continue
        say(f"terminated {kind} instance(s) {', '.join(ids)} of cluster {account.name}; {kind} no longer lists them")
        done += ids
    return done

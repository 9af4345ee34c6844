"""`down` of a cluster whose record is damaged: terminate what the vendor lists for it.

A damaged cluster record (a truncated write, a hand edit, a field that no longer validates) must
not keep a paid instance running, and deleting it by hand would orphan the instance. What the
file still says is read raw (its provider, API origin, region, instance ids); where it does not
name a rented provider, the config's provider is used when the config is this cluster's. The
vendor's own list decides: every instance whose label is one `up` gives this cluster's nodes
(gpuctl-NAME-INDEX-ATTEMPT) or whose id the file names is terminated and waited for; only then
does the record go. A cluster on your own machines (local, ssh) rents nothing: its damaged record
stays an error whose fix says how to restore or forget it.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from provision.core import state
from provision.core.errors import GpuctlError, StateError
from provision.core.provider_config import CloudProvider
from provision.core.state import ClusterRecord, NodeRecord
from provision.core.terminal import scrub
from provision.providers import backend
from provision.providers.cloud import CloudBackend
from provision.providers.instance import Instance

ACTIVE = ("starting", "running")


def label_re(name: str) -> re.Pattern[str]:
    """The labels cloud.py's `up` gives a cluster's instances: gpuctl-NAME-INDEX-ATTEMPT (6 hex digits)."""
    return re.compile(rf"^gpuctl-{re.escape(name)}-\d+-[0-9a-f]{{6}}$")


def _text(raw: dict[str, object], key: str) -> str | None:
    value = raw.get(key)
    return value if isinstance(value, str) else None


def stand_in(name: str, raw: dict[str, object], fallback: CloudProvider | None) -> ClusterRecord | None:
    """A record with what the vendor calls need, from the damaged file's raw fields (or the
    config's provider); None when neither names a provider that rents machines."""
    kind = _text(raw, "provider")
    api_url, region = _text(raw, "api_url"), _text(raw, "region")
    fallback_kind = getattr(fallback, "kind", None)  # (each vendor's model has its own Literal kind)
    if kind not in state.RENTED and fallback is not None and fallback_kind in state.RENTED:
        kind, api_url, region = fallback_kind, api_url or fallback.api_url, region or getattr(fallback, "region", None)
    if kind not in state.RENTED:
        return None
    nodes = raw.get("nodes")
    records = []
    for i, node in enumerate(nodes if isinstance(nodes, list) else []):
        found = node.get("instance_id") if isinstance(node, dict) else None
        if isinstance(found, (str, int)) and not isinstance(found, bool) and str(found).strip():
            records.append(NodeRecord(host=f"node{i}", instance_id=str(found)))
    return ClusterRecord(
        name=name, provider=kind, nodes=records or [NodeRecord(host="node0")], api_url=api_url, region=region
    )


def down_damaged(
    name: str,
    damage: StateError,
    say: Callable[[str], None],
    *,
    fallback: CloudProvider | None = None,
    confirm: Callable[[str], bool] | None = None,
) -> None:
    """Terminate what the vendor lists for cluster `name`, whose record does not load; then forget it."""
    record = stand_in(name, state.raw_record(state.cluster_file(name)), fallback)
    if record is None:
        raise damage
    provider = backend(record.provider)
    assert isinstance(provider, CloudBackend)  # every RENTED kind is a cloud backend
    say(f"warning: {damage.message}; looking up what {record.provider} lists for cluster {name}")
    ids = {n.instance_id for n in record.nodes if n.instance_id}
    ours = label_re(name)
    found = [i for i in provider.list_instances(record) if ours.match(i.label) or i.id in ids]
    if found and confirm is not None and not confirm(f"terminate {_listing(found)} of cluster {name}?"):
        raise GpuctlError(f"not confirmed: cluster {name}'s instances still run", "rerun `gpuctl down` and answer y")
    for inst in found:
        provider.terminate(record, inst.id)
    provider.wait_gone(record, [i.id for i in found])
    provider.release(record, say)
    provider.forget_local(record)
    runs, _damaged = state.scan_runs(name)
    for run in runs:
        if run.state in ACTIVE:
            state.update_run(run.run_id, state="lost")  # its node is gone
    state.delete_cluster(name)
    say(f"terminated {len(found)} {record.provider} instance(s); {record.provider} no longer lists them")


def _listing(found: list[Instance]) -> str:
    return scrub(f"{len(found)} instance(s) ({', '.join(f'{i.id} {i.label} {i.state}' for i in found)})")

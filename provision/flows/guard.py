"""The budget cap as a node-level guard: started by `gpuctl up`, outside every run.

A cap (provider.max_hours / max_cost) counts from the cluster's creation, whether a run is
going, finished early, was cancelled, or never started. So the guard belongs to the node, not
to a run: `up` writes <workdir>/guard/ on the first node

    guard.sh    the guard (values baked in with shlex.quote), 0700
    guard.env   what the teardown needs (Vast.ai/RunPod: the API key), 0600 from its creation
    guard.pid   its pid; guard.log its output

and starts guard.sh with setsid nohup: its own session and process group, so no run's
`cancel` (a signal to the run's group) reaches it, and it outlives the SSH connection that
started it. At the deadline it sends TERM to every running run's process group (the pgid in
its status.json), gives them a minute for their final checkpoint sync, and runs the provider's
self-teardown (retried for an hour). Only `gpuctl down` removes it: the node goes with it.

The deadline is computed on the node from the seconds left when `up` starts the guard, so a
node clock that is off does not move the cap. A provider may add a second line of defence
on every node (`ProviderBackend.backstop`; AWS: `shutdown -h +N` with terminate-on-shutdown).
"""

from __future__ import annotations

import math
import shlex
import time
from collections.abc import Callable

from provision.core import state
from provision.core.errors import ConfigError, RemoteError
from provision.providers.base import ProviderBackend
from provision.transport.remote import Node

GUARD_DIR = "guard"
STOP_WAIT_S = 60  # for the runs' final checkpoint sync, as a cancelled run gets
RETRIES = 12  # teardown attempts, 5 minutes apart
BACKSTOP_SLACK_MIN = 3  # the backstop fires this long after the guard would have

GUARD_SH = r"""#!/usr/bin/env bash
# gpuctl budget guard of cluster {cluster}: written by `gpuctl up`; it goes with the node at `gpuctl down`.
set -u
cd {folder} || exit 1
echo $$ > guard.pid
DEADLINE=$(( $(date +%s) + {left} ))
echo "gpuctl: budget guard up: cap {cap}; the node tears itself down in {left}s ($(date -d "@$DEADLINE" 2>/dev/null))"
while now=$(date +%s); [ "$now" -lt "$DEADLINE" ]; do
  left=$((DEADLINE - now)); sleep $(( left < 30 ? left : 30 ))
done
echo "gpuctl: budget cap reached ({cap} since the cluster was created): stopping its runs and tearing the node down"
running() {{
  for s in {runs}/*/status.json; do
    [ -f "$s" ] && grep -q '"state": "running"' "$s" && printf '%s\n' "$s"
  done
}}
running | while IFS= read -r s; do
  pgid=$(sed -n 's/.*"pgid": \([0-9][0-9]*\).*/\1/p' "$s")
  [ -n "$pgid" ] && kill -TERM -- "-$pgid" 2>/dev/null && echo "gpuctl: stopped run ${{s%/status.json}}"
done
for _ in $(seq {stop_wait}); do [ -z "$(running)" ] && break; sleep 1; done
set -a; [ -f guard.env ] && . ./guard.env; set +a
for attempt in $(seq {retries}); do
  {teardown} && exit 0
  echo "gpuctl: self-teardown failed (attempt $attempt of {retries}); retrying in 5 minutes"
  sleep 300
done
exit 1
"""


def guard_dir(workdir: str) -> str:
    return f"{workdir.rstrip('/')}/{GUARD_DIR}"


def seconds_left(cluster: state.ClusterRecord, now: float | None = None) -> int:
    """Seconds from now until the cap (0 when it has passed: the guard tears down at once)."""
    assert cluster.budget_hours is not None  # only called for a capped cluster
    end = cluster.created_at + cluster.budget_hours * 3600
    return max(0, math.floor(end - (time.time() if now is None else now)))


def script(cluster: state.ClusterRecord, teardown: list[str], left: int, *, stop_wait: int = STOP_WAIT_S) -> str:
    hours = cluster.budget_hours or 0
    cap = f"{hours:.2f} h" if hours >= 1 else f"{hours * 60:.1f} min"
    first = cluster.nodes[0]
    return GUARD_SH.format(
        cluster=cluster.name,
        folder=shlex.quote(guard_dir(first.workdir)),
        runs=shlex.quote(f"{first.workdir.rstrip('/')}/runs"),
        left=int(left),
        cap=cap,
        stop_wait=int(stop_wait),
        retries=RETRIES,
        teardown=shlex.join(teardown),
    )


def start(
    cluster: state.ClusterRecord,
    provider: ProviderBackend,
    nodes: list[Node],
    say: Callable[[str], None],
    *,
    stop_wait: int = STOP_WAIT_S,
) -> int:
    """Start the guard on the first node (and the provider's backstop on every node); its pid."""
    teardown = provider.self_teardown(cluster)
    if teardown is None:
        raise ConfigError(
            f"provider {cluster.provider} cannot tear a node down by itself, so a budget cap cannot hold",
            "remove provider.max_hours / max_cost",
        )
    left = seconds_left(cluster)
    folder = guard_dir(cluster.nodes[0].workdir)
    first = nodes[0]
    first.sh('mkdir -p -- "$1" && chmod 700 -- "$1"', folder, timeout=60)
    env = "".join(f"{k}={shlex.quote(v)}\n" for k, v in teardown.env.items())
    first.write_text(f"{folder}/guard.env", env, "600")  # written under umask 077: 0600 from the start
    first.write_text(f"{folder}/guard.sh", script(cluster, teardown.argv, left, stop_wait=stop_wait), "700")
    pid = first.start_detached(folder, "guard.sh", "guard.log")
    if not first.group_alive(pid):
        log = (first.read_text(f"{folder}/guard.log") or "").strip()[-300:]
        raise RemoteError(f"the budget guard on {first.label} did not start: {log or 'no output'}")
    say(f"budget guard started on {cluster.nodes[0].host}: it tears the cluster down in {left / 60:.1f} min")
    _backstop(cluster, provider, nodes, left, say)
    return pid


def _backstop(
    cluster: state.ClusterRecord, provider: ProviderBackend, nodes: list[Node], left: int, say: Callable[[str], None]
) -> None:
    minutes = math.ceil(left / 60) + BACKSTOP_SLACK_MIN
    for rec, node in zip(cluster.nodes, nodes, strict=True):
        argv = provider.backstop(cluster, rec, minutes)
        if argv is None:
            continue
        result = node.run(argv, check=False, timeout=60)
        if result.rc != 0:  # the guard is the first line; say so, do not fail `up` over the second
            detail = (result.stderr.strip() or result.stdout.strip())[-200:]
            say(f"warning: {rec.host}: could not schedule `{shlex.join(argv)}` as a second line: {detail}")
        else:
            say(f"{rec.host}: scheduled `{shlex.join(argv)}` as a second line of defence")

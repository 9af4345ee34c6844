"""The budget cap as node-level guards: started by `gpuctl up`, outside every run.

A cap (provider.max_hours / max_cost) counts from the cluster's creation, whether a run is
going, finished early, was cancelled, or never started. So the guard belongs to the node, not
to a run: `up` writes <workdir>/guard/ on every node

    guard.sh      node 0's guard (values baked in with shlex.quote), 0700; guard.env what its
                  teardown needs (Vast.ai/RunPod: the API key), 0600; guard.pid, guard.log
    backstopN.*   node N's own guard (N > 0): the same deadline plus BACKSTOP_SLACK_MIN, then it
                  deletes that node alone, should node 0's guard not have done it
    boot.sh       the boot hook: restarts each guard here that is not running

and starts each guard with setsid nohup: its own session and process group, so no run's
`cancel` (a signal to the run's group) reaches it, and it outlives the SSH connection that
started it. At the deadline node 0's guard sends TERM to every running run's process group (the
pgid in its status.json), gives them a minute for their final checkpoint sync, and runs the
provider's self-teardown (retried for an hour). Only `gpuctl down` removes them: the node goes
with them.

The deadline is an instant on the node's own clock, fixed when `up` starts the guard from the
seconds then left (a node clock that is off does not move the cap) and written into the
script: a container or machine restart does not reset it. The vendor's start-up runs boot.sh
at every start (Vast: onstart; RunPod: the image's entrypoint; AWS: a cloud-init per-boot
script), which starts the guards again with their deadline unchanged.

Before a guard starts, its teardown is tried dry from the node (the provider's check: the key
and endpoint it got must show the instances it would delete); a failure fails `up`, which then
terminates what it created. A guard started again (a replaced node) first stops the one before
it, and each file is written beside its place and renamed over it: bash reads a script as it
runs, so a file rewritten in place could run half of each. A provider may add a second line of
defence on every node (`ProviderBackend.backstop`; AWS: `shutdown -h +N`, which must succeed).
"""

from __future__ import annotations

import math
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass

from provision.core import state
from provision.core.errors import ConfigError, ProviderError, RemoteError
from provision.providers.base import ProviderBackend, SelfTeardown
from provision.providers.http import redact
from provision.transport.remote import Node

GUARD_DIR = "guard"  # BOOT_HOOK (the vendors' start-up) looks for guard/boot.sh in the workdir
STOP_WAIT_S = 60  # for the runs' final checkpoint sync, as a cancelled run gets
RETRIES = 12  # teardown attempts, 5 minutes apart
BACKSTOP_SLACK_MIN = 3  # the backstops fire this long after node 0's guard would have
CHECK_TIMEOUT_S = 120

GUARD_SH = r"""#!/usr/bin/env bash
# gpuctl budget {role} of cluster {cluster}, node {index}: written by `gpuctl up`; it goes with the node.
# DEADLINE is this node's clock at `up` plus what was left of the cap: a restart (boot.sh) keeps it.
set -u
cd {folder} || exit 1
echo $$ > {name}.pid
DEADLINE={deadline}
echo "gpuctl: budget {role} up: cap {cap}; deadline $DEADLINE ($(date -d "@$DEADLINE" 2>/dev/null)), in $((DEADLINE - $(date +%s)))s"
while now=$(date +%s); [ "$now" -lt "$DEADLINE" ]; do
  left=$((DEADLINE - now)); sleep $(( left < 30 ? left : 30 ))
done
{at_deadline}
set -a; [ -f {name}.env ] && . ./{name}.env; set +a
for attempt in $(seq {retries}); do
  {teardown} && exit 0
  echo "gpuctl: self-teardown failed (attempt $attempt of {retries}); retrying in 5 minutes"
  sleep 300
done
exit 1
"""
STOP_RUNS = r"""echo "gpuctl: budget cap reached ({cap} since the cluster was created): stopping its runs and tearing the node down"
running() {{
  for s in {runs}/*/status.json; do
    [ -f "$s" ] && grep -q '"state": "running"' "$s" && printf '%s\n' "$s"
  done
}}
running | while IFS= read -r s; do
  pgid=$(sed -n 's/.*"pgid": \([0-9][0-9]*\).*/\1/p' "$s")
  [ -n "$pgid" ] && kill -TERM -- "-$pgid" 2>/dev/null && echo "gpuctl: stopped run ${{s%/status.json}}"
done
for _ in $(seq {stop_wait}); do [ -z "$(running)" ] && break; sleep 1; done"""
SELF_ONLY = (
    'echo "gpuctl: budget cap reached ({cap} since the cluster was created) and this node is still here: deleting it"'
)

# A guard is running when its pid file names a live process whose command line holds its script
# (after a restart the pid may belong to something else; a zombie's command line is empty).
_ALIVE = (
    'alive() { p=$(cat -- "${1%.sh}.pid" 2>/dev/null); case "$p" in ""|*[!0-9]*) return 1;; esac; '
    'tr "\\0" " " < "/proc/$p/cmdline" 2>/dev/null | grep -qF -- "$1"; }'
)
BOOT_SH = f"""#!/usr/bin/env bash
# gpuctl: the boot hook of a capped node, run by the vendor's start-up at every start of the container
# or machine. Each budget guard here that is not running starts again, its deadline unchanged.
cd "$(dirname -- "$0")" || exit 0
{_ALIVE}
for g in *.sh; do
  {{ [ "$g" = boot.sh ] || [ ! -f "$g" ] || alive "$g"; }} && continue
  setsid nohup bash "$g" >> "${{g%.sh}}.log" 2>&1 < /dev/null &
  echo "gpuctl: started the budget guard $g again"
done
"""
# Stop the guards a folder holds (a guard started again replaces them): TERM, then KILL, their group.
STOP_OLD = f"""cd "$1" 2>/dev/null || exit 0
{_ALIVE}
for g in *.sh; do
  [ "$g" != boot.sh ] && alive "$g" || continue
  kill -TERM -- "-$p" 2>/dev/null || kill -TERM "$p" 2>/dev/null
  for _ in $(seq 100); do alive "$g" || break; sleep 0.1; done
  kill -KILL -- "-$p" 2>/dev/null
done
true"""


@dataclass
class Plan:
    """One node's guard: its files' name, when it fires (after the cap), what it deletes."""

    index: int
    name: str
    teardown: SelfTeardown
    slack_s: int


def guard_dir(workdir: str) -> str:
    return f"{workdir.rstrip('/')}/{GUARD_DIR}"


def node_deadline(cluster: state.ClusterRecord, node_now: int) -> int:
    """The cap as an instant on the node's clock, read (`date +%s`, truncated) just before: rounded up,
    so the guard never fires before the cap (at most 2 s after it); `node_now` when it has passed."""
    assert cluster.budget_hours is not None  # only called for a capped cluster
    end = cluster.created_at + cluster.budget_hours * 3600
    return node_now + max(0, math.ceil(end - time.time()) + 1)


def _cap_text(cluster: state.ClusterRecord) -> str:
    hours = cluster.budget_hours or 0
    return f"{hours:.2f} h" if hours >= 1 else f"{hours * 60:.1f} min"


def script(
    cluster: state.ClusterRecord, teardown: list[str], deadline: int, *, stop_wait: int = STOP_WAIT_S, index: int = 0
) -> str:
    """The guard of node `index` (0: stops the runs, deletes the cluster; else: deletes itself)."""
    node = cluster.nodes[index]
    cap = _cap_text(cluster)
    runs = shlex.quote(f"{node.workdir.rstrip('/')}/runs")
    at_deadline = (
        STOP_RUNS.format(cap=cap, runs=runs, stop_wait=int(stop_wait)) if index == 0 else SELF_ONLY.format(cap=cap)
    )
    return GUARD_SH.format(
        role="guard" if index == 0 else "backstop",
        cluster=cluster.name,
        index=index,
        name=_name(index),
        folder=shlex.quote(guard_dir(node.workdir)),
        deadline=int(deadline),
        cap=cap,
        at_deadline=at_deadline,
        retries=RETRIES,
        teardown=shlex.join(teardown),
    )


def _name(index: int) -> str:
    return "guard" if index == 0 else f"backstop{index}"


def start(
    cluster: state.ClusterRecord,
    provider: ProviderBackend,
    nodes: list[Node],
    say: Callable[[str], None],
    *,
    stop_wait: int = STOP_WAIT_S,
) -> int:
    """Start the guards (node 0's, then each other node's own) and the provider's backstop on every
    node; the pid of node 0's guard. Any failure raises: the caller takes the cluster down."""
    teardown = provider.self_teardown(cluster)
    if teardown is None:
        raise ConfigError(
            f"provider {cluster.provider} cannot tear a node down by itself, so a budget cap cannot hold",
            "remove provider.max_hours / max_cost",
        )
    plans = [Plan(0, _name(0), teardown, 0)]
    for i, rec in enumerate(cluster.nodes[1:], start=1):
        own = provider.node_teardown(cluster, rec)
        if own is not None:
            plans.append(Plan(i, _name(i), own, BACKSTOP_SLACK_MIN * 60))
    for rec, node in zip(cluster.nodes, nodes, strict=True):  # all first: on a shared disk one folder serves all
        node.sh(STOP_OLD, guard_dir(rec.workdir), timeout=60)
    left = max(0.0, cluster.created_at + (cluster.budget_hours or 0) * 3600 - time.time())  # what `up` says
    pid = 0
    for plan in plans:
        started = _start_one(cluster, nodes[plan.index], plan, stop_wait)
        pid = pid or started
        if plan.index == 0:
            say(f"budget guard started on {cluster.nodes[0].host}: it tears the cluster down in {left / 60:.1f} min")
        else:
            say(f"{cluster.nodes[plan.index].host}: its own guard deletes it {BACKSTOP_SLACK_MIN} min after the cap")
    _backstop(cluster, provider, nodes, left, say)
    return pid


def _start_one(cluster: state.ClusterRecord, node: Node, plan: Plan, stop_wait: int) -> int:
    folder = guard_dir(cluster.nodes[plan.index].workdir)
    node.sh('mkdir -p -- "$1" && chmod 700 -- "$1"', folder, timeout=60)
    env = "".join(f"{k}={shlex.quote(v)}\n" for k, v in plan.teardown.env.items())
    _put(node, f"{folder}/{plan.name}.env", env, "600")  # written under umask 077: 0600 from the start
    _dry_run(cluster, node, plan, folder)
    now = int(node.sh("date +%s", timeout=60).stdout.strip())  # the node's clock: the deadline is its instant
    deadline = node_deadline(cluster, now) + plan.slack_s
    text = script(cluster, plan.teardown.argv, deadline, stop_wait=stop_wait, index=plan.index)
    _put(node, f"{folder}/{plan.name}.sh", text, "700")
    _put(node, f"{folder}/boot.sh", BOOT_SH, "700")
    pid = node.start_detached(folder, f"{plan.name}.sh", f"{plan.name}.log")
    if not node.group_alive(pid):
        log = (node.read_text(f"{folder}/{plan.name}.log") or "").strip()[-300:]
        raise RemoteError(f"the budget guard on {node.label} did not start: {log or 'no output'}")
    return pid


def _put(node: Node, path: str, text: str, mode: str) -> None:
    """Write beside the file, then rename over it: a running guard keeps reading the old one whole."""
    node.write_text(f"{path}.new", text, mode)
    node.sh('mv -f -- "$1.new" "$1"', path, timeout=60)


def _dry_run(cluster: state.ClusterRecord, node: Node, plan: Plan, folder: str) -> None:
    """The guard's teardown tried now, read-only, from the node with the env it will use."""
    check = plan.teardown.check
    if not check:
        return
    run = 'cd "$1" || exit 1; set -a; . "./$2"; set +a; shift 2; exec "$@"'
    result = node.sh(run, folder, f"{plan.name}.env", *check, check=False, timeout=CHECK_TIMEOUT_S)
    if result.rc != 0:
        said = (result.stdout.strip() or result.stderr.strip()).splitlines() or ["no output"]
        for secret in plan.teardown.env.values():
            said = [redact(line, secret) for line in said]
        raise ProviderError(
            f"the budget guard on {node.label} could not reach {cluster.provider} with its key: {said[-1][:300]}",
            f"give gpuctl a {cluster.provider} API key that can read and delete instances, reachable from the node "
            "(or remove provider.max_hours / max_cost)",
        )


def _backstop(
    cluster: state.ClusterRecord, provider: ProviderBackend, nodes: list[Node], left: float, say: Callable[[str], None]
) -> None:
    minutes = math.ceil(left / 60) + BACKSTOP_SLACK_MIN
    for rec, node in zip(cluster.nodes, nodes, strict=True):
        argv = provider.backstop(cluster, rec, minutes)
        if argv is None:
            continue
        result = node.run(argv, check=False, timeout=60)
        if result.rc != 0:  # a second line that is not there: the cap would rest on the guard alone
            detail = " ".join((result.stderr.strip() or result.stdout.strip()).split())[-200:]
            raise RemoteError(
                f"{rec.host}: could not schedule `{shlex.join(argv)}`, the budget cap's second line: "
                f"{detail or f'exit {result.rc}'}",
                f"let {rec.user or 'the login user'} run it (passwordless sudo for shutdown), "
                "or remove provider.max_hours / max_cost",
            )
        say(f"{rec.host}: scheduled `{shlex.join(argv)}` as a second line of defence")

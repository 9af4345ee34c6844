"""Every rich table gpuctl prints: status, offers, checkpoints, plan. Commands pass data in."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import RenderableType

    from provision.estimate.plan_result import PlanResult
    from provision.flows.sweep import Sweep
    from provision.providers.base import Offer
    from trainer.objstore.layout import CheckpointInfo


def _ago(epoch: float | None) -> str:
    if not epoch:
        return "-"
    secs = int(time.time() - epoch)
    return f"{secs // 3600}h{secs % 3600 // 60:02d}m" if secs >= 3600 else f"{secs // 60}m{secs % 60:02d}s"


def _address(provider: str, node: dict[str, Any]) -> str:
    """Where the node is: for provider local this machine by name (no ssh port is involved)."""
    if provider == "local":
        import socket

        return f"{socket.gethostname()} (this machine)"
    return f"{node['address']}:{node['port']}"


def print_status(info: dict[str, Any]) -> None:
    """Strings that came from a node or a vendor (GPU names, states, reasons) are scrubbed of
    terminal escapes and printed without rich markup."""
    from rich.console import Console
    from rich.table import Table

    from provision.core.terminal import scrub

    console = Console()
    cluster = info.get("cluster")
    if cluster:
        table = Table(
            "node",
            "slots",
            "accelerator",
            "address",
            title=f"cluster {cluster['name']} ({cluster['provider']}, up {_ago(cluster['created_at'])})",
        )
        for node in cluster["nodes"]:
            table.add_row(
                node["host"],
                str(node["slots"]),
                scrub(str(node.get("gpu_name") or node["accelerator"])),
                _address(cluster["provider"], node),
            )
        console.print(table)
        if cluster.get("creating"):
            console.print(
                "not up yet: an `up` is creating it, or was stopped before it finished "
                "(`gpuctl up` replaces it, `gpuctl down` removes it)",
                highlight=False,
            )
        if cluster.get("price_per_hour"):
            hours = (time.time() - cluster["created_at"]) / 3600
            spent = cluster.get("spent_cost") or 0.0  # earlier clusters of a recovered run
            console.print(
                f"cost so far: ${cluster['price_per_hour'] * hours + spent:.2f} at ${cluster['price_per_hour']:.3f}/h"
            )
        from provision.cli.doctor_view import print_summary

        print_summary(cluster.get("doctor"))
    else:
        console.print("no cluster is up (gpuctl up)")
    run = info.get("run")
    if not run:
        console.print("no run yet (gpuctl train)")
        return
    loss = run.get("final_loss")
    tps = run.get("tokens_per_s")
    from rich.text import Text

    line = Text.assemble(f"run {run['run_id']}: ", (scrub(str(run.get("state"))), "bold"))
    if isinstance(loss, (int, float)):
        line.append(f"  step {run.get('steps') or 0}/{run.get('max_steps')}  loss {loss:.4f}")
    console.print(line, highlight=False)
    if isinstance(tps, (int, float)):
        console.print(f"tokens/s {tps:,.0f}  world size {run.get('world_size')}  batch {run.get('train_batch_size')}")
    for text in info.get("startup") or []:  # flows/startup_phases.py
        console.print(scrub(text), highlight=False, markup=False)
    for i, event in enumerate(run.get("restarts") or [], 1):  # flows/recover.py: one per lost node
        console.print(
            scrub(
                f"restart {i}, {_ago(event.get('at'))} ago: {event.get('reason')}; instance {event.get('old_instance')} -> "
                f"{event.get('new_instance')}, resumed from {event.get('resumed_from')} (step {event.get('step')}), "
                f"cost so far ${event.get('cost_so_far', 0):.2f}"
            ),
            highlight=False,
            markup=False,
        )


def print_sweep(found: Sweep) -> None:
    """`gpuctl sweep`'s findings: one row per stray instance, what it costs, what was left alone."""
    from rich.console import Console
    from rich.table import Table

    console, notes = Console(), Console(stderr=True)
    for line in [*found.skipped, *(f"error: {e}" for e in found.errors)]:
        notes.print(line, highlight=False, markup=False)
    where = ", ".join(found.checked) or "no account"
    if not found.strays:
        console.print(f"no stray gpuctl instance on {where}", highlight=False, markup=False)
        return
    table = Table(
        "provider", "instance", "cluster", "state", "$/h", "why", title=f"gpuctl instances no record owns ({where})"
    )
    for s in found.strays:
        price = s.instance.price_per_hour
        table.add_row(
            s.kind, s.instance.id, s.account.name, s.instance.state, f"{price:.3f}" if price is not None else "?", s.why
        )
    console.print(table)
    console.print(f"total ${found.price_per_hour:.3f}/h", highlight=False)


def print_offers(offers: list[Offer], title: str) -> None:
    """Cloud offers (providers.cloud.Offer), cheapest first; an empty list says so."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not offers:
        console.print(f"no offer matches {title.split(' ', 2)[-1]}", highlight=False)
        return
    from rich.text import Text

    from provision.core.terminal import scrub

    table = Table("offer", "GPUs", "$/h", "RAM GB", "disk GB", "where", "reliability", title=title)
    for o in offers:  # ids, GPU names and places are the vendor's words: scrubbed, no rich markup
        table.add_row(
            Text(scrub(o.id)),
            Text(scrub(f"{o.num_gpus} x {o.gpu_name}")),
            f"{o.price_per_hour:.3f}" + (" bid" if o.spot else ""),  # interruptible: the bid gpuctl sends
            f"{o.ram_gb:.0f}" if o.ram_gb else "-",
            f"{o.disk_gb:.0f}" if o.disk_gb else "-",
            Text(scrub(o.where or "-")),
            f"{o.reliability:.3f}" if o.reliability is not None else "-",
        )
    console.print(table)


def print_checkpoints(infos: list[CheckpointInfo], latest: CheckpointInfo | None) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table("tag", "step", "size", "complete", "time", "ranks")
    for i in infos:
        mark = " (latest)" if latest and latest.tag == i.tag else ""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i.time)) if i.time else "-"
        table.add_row(
            i.tag + mark,
            str(i.step),
            f"{i.size / 1e6:,.1f} MB",
            "REFUSED" if i.problem else "yes" if i.complete else "no",
            when,
            str(i.world_size or "-"),
        )
    console = Console()
    console.print(table if infos else "no checkpoints yet")
    for i in infos:
        if i.problem:  # the manifest's own text is quoted in it (repr): no markup, no control bytes
            console.print(Text(f"{i.tag}: refused, never pulled: {i.problem}"), soft_wrap=True)


def plan_table(result: PlanResult) -> RenderableType:
    """A rich renderable: the per-rank breakdown, the verdict and the why lines."""
    from rich.console import Group
    from rich.table import Column, Table
    from rich.text import Text

    mem, inp, ok = result.memory, result.input, result.fits
    where = f"{inp.gpus_per_node}x {result.gpu.name}" + (f" x {inp.nodes} nodes" if inp.nodes > 1 else "")
    title = (
        f"{result.model.name} on {where}, ZeRO-{inp.zero_stage}, offload {inp.offload_optimizer}, "
        f"{inp.precision}, micro {inp.micro_batch} x seq {inp.seq_len}"
        f"{', checkpointing' if inp.gradient_checkpointing else ''}"
    )
    table = Table("per rank", Column("GB", justify="right"), title=title)
    for label, gb in (
        ("weights", mem.weights_gb),
        ("gradients", mem.grads_gb),
        ("optimizer states", mem.optimizer_gb),
        ("buffers", mem.buffers_gb),
        ("activations", mem.activations_gb),
        ("fragmentation", mem.fragmentation_gb),
        ("CUDA context", mem.cuda_context_gb),
    ):
        table.add_row(label, f"{gb:.2f}")
    style = "bold " + ("green" if ok else "red")
    table.add_row("total", f"{mem.total_gb:.2f} / {result.gpu_capacity_gb:g}", style=style)
    table.add_row("tokens/s, compute only", f"{result.tokens_per_s_low:,.0f}-{result.tokens_per_s_high:,.0f}")
    verdict = Text("FITS" if ok else "DOES NOT FIT", style=style)
    return Group(table, node_table(result), verdict, *(Text(f"- {line}") for line in result.why))


PINNING = {"exact": "pinned exact-size", "off": "not pinned", "pow2": "pinned, rounded to powers of two"}


def node_table(result: PlanResult) -> RenderableType:
    """Host RAM per node at load, steady, resume and save, and the node's disk, each term named."""
    import math

    from rich.table import Column, Table

    node = result.node
    table = Table(
        "per node",
        Column("load GB", justify="right"),
        Column("steady GB", justify="right"),
        Column("resume GB", justify="right"),
        Column("save GB", justify="right"),
        title=f"host RAM per node ({node.ranks} ranks, {result.input.strategy}, offload buffers "
        f"{PINNING[node.pinning]}) and disk",
    )
    phases = (node.load, node.steady, node.resume, node.save)
    names = list(dict.fromkeys(t.name for phase in phases for t in phase))
    for name in names:
        table.add_row(name, *(f"{sum(t.gb for t in ph if t.name == name):.1f}" for ph in phases))
    totals = (node.load_gb, node.steady_gb, node.resume_gb, node.save_gb)
    table.add_row("total", *(f"{gb:.1f}" for gb in totals), style="bold")
    table.add_row(f"rent (worst + {node.reserve_gb:g} GB OS)", "", f"{math.ceil(node.ram_gb)}", "", "", style="bold")
    for term in node.disk:
        table.add_row(f"disk: {term.name}", "", f"{term.gb:.1f}", "", "")
    table.add_row("disk total", "", f"{math.ceil(node.disk_gb)}", "", "", style="bold")
    return table

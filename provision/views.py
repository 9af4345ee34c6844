"""Human-readable views (rich). Kept apart from cli.py so the wiring stays wiring."""

from __future__ import annotations

import time


def _ago(epoch: float | None) -> str:
    if not epoch:
        return "-"
    secs = int(time.time() - epoch)
    return f"{secs // 3600}h{secs % 3600 // 60:02d}m" if secs >= 3600 else f"{secs // 60}m{secs % 60:02d}s"


def print_status(info: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    cluster = info.get("cluster")
    if cluster:
        table = Table("node", "slots", "accelerator", "address", title=f"cluster {cluster['name']} "
                      f"({cluster['provider']}, up {_ago(cluster['created_at'])})")
        for node in cluster["nodes"]:
            table.add_row(node["host"], str(node["slots"]), node.get("gpu_name") or node["accelerator"],
                          f"{node['address']}:{node['port']}")
        console.print(table)
        if cluster.get("price_per_hour"):
            hours = (time.time() - cluster["created_at"]) / 3600
            console.print(f"cost so far: ${cluster['price_per_hour'] * hours:.2f} "
                          f"at ${cluster['price_per_hour']:.3f}/h")
    else:
        console.print("no cluster is up (gpuctl up)")
    run = info.get("run")
    if not run:
        console.print("no run yet (gpuctl train)")
        return
    loss = run.get("final_loss")
    tps = run.get("tokens_per_s")
    console.print(f"run {run['run_id']}: [bold]{run.get('state')}[/bold]"
                  f"  step {run.get('steps') or 0}/{run.get('max_steps')}"
                  f"  loss {loss:.4f}" if isinstance(loss, (int, float)) else
                  f"run {run['run_id']}: {run.get('state')}", highlight=False)
    if isinstance(tps, (int, float)):
        console.print(f"tokens/s {tps:,.0f}  world size {run.get('world_size')}"
                      f"  batch {run.get('train_batch_size')}")


def print_offers(offers: list, title: str) -> None:
    """Cloud offers (providers.cloud.Offer), cheapest first; an empty list says so."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not offers:
        console.print(f"no offer matches {title.split(' ', 2)[-1]}", highlight=False)
        return
    table = Table("offer", "GPUs", "$/h", "RAM GB", "disk GB", "where", "reliability", title=title)
    for o in offers:
        table.add_row(o.id, f"{o.num_gpus} x {o.gpu_name}", f"{o.price_per_hour:.3f}",
                      f"{o.ram_gb:.0f}" if o.ram_gb else "-", f"{o.disk_gb:.0f}" if o.disk_gb else "-",
                      o.where or "-", f"{o.reliability:.3f}" if o.reliability is not None else "-")
    console.print(table)

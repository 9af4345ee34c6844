"""Prices and the budget cap: what every place that computes a cap shares (cloud.py's `up`, a
replaced node in flows/replace_node.py), and the check every $/h figure from a vendor passes.

A cap counts from the cluster's creation and takes what the run's earlier clusters spent (a
recovered run): the new node gets only what is left, at the price its vendor bills it.
"""

from __future__ import annotations

import math

from provision.core.errors import GpuctlError, ProviderError
from provision.core.provider_config import CloudProvider
from provision.core.state import ClusterRecord


def budget_hours(prov: CloudProvider, price_per_hour: float, *, spent_hours: float, spent_cost: float) -> float | None:
    """Hours this cluster may run from its creation; spent_*: what earlier clusters of the same
    run cost (a recovered run), which every cap counts. A cost cap needs a real price: with a
    price that is nan, 0 or negative it could never come, so that is an error, not "no cap"."""
    caps = [prov.max_hours - spent_hours] if prov.max_hours else []
    if prov.max_cost:
        if not (math.isfinite(price_per_hour) and price_per_hour > 0):
            raise ProviderError(
                f"provider.max_cost cannot be enforced: the price is {price_per_hour!r} $/h, not a positive number",
                "set provider.max_hours instead of max_cost, or pick an offer with a real price",
            )
        caps.append((prov.max_cost - spent_cost) / price_per_hour)
    return min(caps) if caps else None


def cluster_cap(prov: CloudProvider, cluster: ClusterRecord) -> float | None:
    """The cap of a cluster at its recorded price, counting what the run's earlier clusters spent."""
    return budget_hours(
        prov, cluster.price_per_hour or 0.0, spent_hours=cluster.spent_hours, spent_cost=cluster.spent_cost
    )


def vendor_price(value: object, what: str) -> float:
    """A $/h figure from a vendor's answer, checked: a finite number above 0 (nan, 0, a negative or
    a string would make the shown cost and the budget cap meaningless). `what` names the field."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ProviderError(
            f"{what} is {str(value)[:40]!r}, not a price in $/h",
            "retry later (the vendor's answer is malformed), or set provider.max_price to skip such offers",
        )
    return float(value)


def not_spent(cap: float | None, spent_hours: float, spent_cost: float) -> None:
    if cap is not None and cap <= 0:
        raise GpuctlError(
            f"the budget cap is spent ({spent_hours:.2f} h, ${spent_cost:.2f} so far)",
            "raise provider.max_hours / max_cost",
        )

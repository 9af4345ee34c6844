"""Field-by-field comparison of what gpuctl sends with what a vendor's official client sends for
the same intent (tests/test_cloud_oracle_*.py). Every difference is one line naming the field,
so a new client release that renames, adds or re-units a field fails with that name.

Rules, per field:
- both send it: the values must be equal (numbers compared as numbers: the Vast client sends
  "3" where gpuctl sends 3, and the server reads both as 3; dicts and lists field by field);
- only the official client sends it: fine if the value is an unset default (None, False, "",
  {} or []); else it must be listed in `theirs_only` with the value it is known to have and why
  gpuctl leaves it out (a changed value is a difference too);
- only gpuctl sends it: it must be listed in `ours_only` with the reason.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

UNSET = (None, False, "", {}, [])
_MISSING = object()


def _norm(value: Any) -> Any:
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    if isinstance(value, dict):
        return {k: _norm(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_norm(v) for v in value]
    return value


def differences(
    what: str,
    ours: dict[str, Any],
    theirs: dict[str, Any],
    *,
    client: str,
    theirs_only: dict[str, tuple[Any, str]] | None = None,
    ours_only: dict[str, str] | None = None,
    prefix: str = "",
) -> list[str]:
    """One line per field that differs; [] when gpuctl and the client agree."""
    theirs_only, ours_only = theirs_only or {}, ours_only or {}
    who = f"{client} {version(client)}"
    out = []
    for name in sorted(set(ours) | set(theirs), key=str):
        label = f"{what}: field {prefix}{name}"
        a, b = ours.get(name, _MISSING), theirs.get(name, _MISSING)
        if a is _MISSING:
            if name in theirs_only:
                known = theirs_only[name][0]
                if _norm(b) != _norm(known):
                    out.append(f"{label}: {who} now sends {b!r} (known: {known!r}); gpuctl leaves it out")
            elif b not in UNSET:
                out.append(f"{label}: {who} sends {b!r}, gpuctl does not send it")
        elif b is _MISSING:
            if name not in ours_only:
                out.append(f"{label}: gpuctl sends {a!r}, {who} does not send it")
        elif isinstance(a, dict) and isinstance(b, dict):
            out += differences(what, a, b, client=client, prefix=f"{prefix}{name}.")
        elif _norm(a) != _norm(b):
            out.append(f"{label}: gpuctl sends {a!r}, {who} sends {b!r}")
    return out

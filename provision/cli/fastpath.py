"""What a whole `gpuctl` process spends outside its command, cut (issue 37; benchmarks/bench_cli.py).

Three costs every command paid, none of them gpuctl's work:
- the cyclic GC: importing typer, pydantic and rich allocates ~60k containers, and the default
  threshold (700) runs a collection every few hundred of them (~20 ms of `gpuctl status`);
- pydantic's plugin lookup: the first model it builds imports importlib.metadata (email, zipfile,
  csv: ~20 ms) to read entry points, even when PYDANTIC_DISABLE_PLUGINS says to load none;
- the interpreter's teardown: freeing every module, schema and table one object at a time
  (~30 ms) after the command has printed all it prints.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
import types

_LOADER = "pydantic.plugin._loader"
_NO_PLUGINS = ("__all__", "1", "true")  # the values pydantic's get_plugins reads as "load none"


def tune() -> None:
    """Before anything is imported: a GC that collects every 50k new containers instead of 700 (a
    long `train` follow still collects), and no pydantic plugins."""
    gc.set_threshold(50_000, 20, 20)
    # gpuctl uses no pydantic plugin (pydantic's documented switch; typer sets it around its own
    # adapters). With it set, pydantic's loader returns () before it reads an entry point, so the
    # loader module is stood in for by one that returns () without importing importlib.metadata.
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    if os.environ["PYDANTIC_DISABLE_PLUGINS"] in _NO_PLUGINS and _LOADER not in sys.modules:
        loader = types.ModuleType(_LOADER, "gpuctl's stand-in: PYDANTIC_DISABLE_PLUGINS loads no plugin")
        loader.get_plugins = lambda: ()  # type: ignore[attr-defined]
        sys.modules[_LOADER] = loader


def leave(code: object) -> None:
    """End the process with `code` as a normal exit would -- atexit hooks run, stdout and stderr
    flushed -- without the teardown. Returns (the caller exits the normal way) when the code is a
    message, a thread still runs (the interpreter would wait for it or its clean-up), or a flush
    fails (a closed pipe: the normal exit reports it as it always did)."""
    if not (code is None or isinstance(code, int)) or threading.active_count() > 1:
        return
    atexit._run_exitfuncs()  # what Py_Finalize runs first; it clears them, so none runs twice
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):  # a closed pipe, a closed or missing stream
        return
    os._exit(code or 0)

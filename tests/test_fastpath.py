"""cli/fastpath.py: gpuctl's process ends as a normal exit would -- exit code, atexit hooks, every
byte written -- without the interpreter's teardown, and not while a thread still works."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

LEAVE = """
import atexit, sys, threading, time
from provision.cli import fastpath
fastpath.tune()
atexit.register(lambda: print("atexit ran", file=sys.stderr))
sys.stdout.write("x" * 300_000)  # more than a pipe holds: still buffered when leave() is called
if len(sys.argv) > 1:  # a worker thread that finishes after leave() is called
    def work():
        time.sleep(0.3)
        with open(sys.argv[1], "w") as fh:
            fh.write("done")
    threading.Thread(target=work).start()
fastpath.leave(3)
sys.exit(3)  # leave() returned: the normal exit
"""


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LEAVE, *args], capture_output=True, text=True, timeout=60)


def test_leave_keeps_the_exit_code_the_output_and_the_atexit_hooks():
    proc = run()
    assert proc.returncode == 3
    assert proc.stdout == "x" * 300_000
    assert proc.stderr.strip() == "atexit ran"


def test_leave_waits_for_a_running_thread_by_exiting_the_normal_way(tmp_path: Path):
    marker = tmp_path / "done"
    proc = run(str(marker))
    assert proc.returncode == 3 and marker.read_text() == "done"
    assert proc.stderr.strip() == "atexit ran"


def test_tune_stands_in_for_the_plugin_loader_only_when_plugins_are_off():
    code = (
        "import os, sys\nfrom provision.cli import fastpath\nfastpath.tune()\n"
        "import pydantic\nclass M(pydantic.BaseModel):\n    a: int = 1\n"
        "print(M(a=2).a, 'importlib.metadata' in sys.modules)"
    )
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert off.stdout.split() == ["2", "False"], off.stderr
    env = {**os.environ, "PYDANTIC_DISABLE_PLUGINS": "some_plugin"}
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert on.stdout.split() == ["2", "True"], on.stderr  # a user's own setting: pydantic looks as before

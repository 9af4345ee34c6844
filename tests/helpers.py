"""Plain helpers shared by the test modules (and the benchmarks). Fixtures built on them live in
tests/conftest.py; the fixture modules (tests/sshd.py, tests/s3server.py, tests/dockerd.py) are
registered there once with ``pytest_plugins``, so a test module only asks for a fixture by
argument name and imports nothing but helper classes and functions from ``tests.X``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# gpuctl as a subprocess; for a Popen of a long-running command. Everything else: run_gpuctl.
GPUCTL = [sys.executable, "-m", "provision.cli"]

# The loss of an exported Hugging Face folder on one global batch of a run (argv: HF_DIR RUN_DIR
# STEP): run with the node-side python, it checks an export against the loss the run logged.
LOSS_ON_BATCH = """
import json, sys
from pathlib import Path
import torch, torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer
from trainer.dataset import PackedTokens, Sampler
hf, run_dir, step = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
tokenizer = AutoTokenizer.from_pretrained(hf)
model = AutoModelForCausalLM.from_pretrained(hf).eval()
train = json.loads((run_dir / "run.json").read_text())["train"]
batch = train["micro_batch"] * train["grad_accum"] * 3
data = PackedTokens(next((run_dir / "cache").glob("tokens-*.bin")), len(tokenizer), train["seq_len"])
inputs, targets = data.batch(Sampler(data.num_samples, train["seed"]).global_batch(step * batch, batch))
with torch.no_grad():
    logits = model(input_ids=inputs).logits
print(F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1)).item())
"""


def parent_of(pid: int | str) -> int:
    """The parent pid, from /proc/<pid>/stat (the command name may hold spaces and parentheses: split
    after its last ")"). OSError when the process is gone."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def free_port(*also: str) -> int:
    """A TCP port free on 127.0.0.1 and, when given, on every address in ``also`` (the loopback
    sshd listens on 127.0.0.1 and 127.0.0.2 with one port)."""
    for _ in range(50):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        try:
            for address in also:
                with socket.socket() as other:
                    other.bind((address, port))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no port free on 127.0.0.1 and {', '.join(also)}")


def run_gpuctl(
    *args: str,
    cwd: Path | str,
    env: Mapping[str, str] | None = None,
    timeout: float = 600,
    check: bool = False,
    input: str | None = None,
) -> subprocess.CompletedProcess:
    """``python -m provision.cli ARGS`` in cwd, output captured as text.

    env is the child's whole environment (None: this process's, as subprocess has it). With check,
    a non-zero exit fails the test with the tail of both streams."""
    out = subprocess.run(
        [*GPUCTL, *args],
        cwd=cwd,
        env=None if env is None else dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input,
    )
    if check:
        assert out.returncode == 0, f"gpuctl {' '.join(args)}: {out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@dataclass
class Gpuctl:
    """run_gpuctl bound to a project dir and an environment; remembers everything gpuctl printed
    (for leak checks). What the ``gpuctl`` fixture returns.

    ``env`` is the whole environment (None: os.environ at the time of each call); a call's
    ``env=`` is laid over it. ``check`` is the default of each call's ``check=``."""

    cwd: Path
    env: Mapping[str, str] | None = None
    check: bool = False
    outputs: list[str] = field(default_factory=list)

    def __call__(
        self,
        *args: str,
        cwd: Path | str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float = 600,
        check: bool | None = None,
        input: str | None = None,
    ) -> subprocess.CompletedProcess:
        base = os.environ if self.env is None else self.env
        out = run_gpuctl(
            *args,
            cwd=self.cwd if cwd is None else cwd,
            env={**base, **(env or {})},
            timeout=timeout,
            check=self.check if check is None else check,
            input=input,
        )
        self.outputs += [out.stdout, out.stderr]
        return out

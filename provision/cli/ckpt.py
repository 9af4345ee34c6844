"""Checkpoint commands: list what the store holds, pull one (optionally as a Hugging Face folder)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from provision.cli.options import ConfigOpt, JsonOpt, load, say

if TYPE_CHECKING:
    from provision.core.config import GpuctlConfig
    from trainer.objstore.store import CheckpointStore

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")  # all but \t \n \r: no escape sequences
app = typer.Typer(help="List and pull checkpoints from the run's storage.", no_args_is_help=True)


def _store(config: Optional[Path]) -> tuple[CheckpointStore, GpuctlConfig]:
    from trainer.objstore.store import CheckpointStore

    cfg = load(config)
    return CheckpointStore.from_config(cfg.storage_settings(), log=say), cfg


@app.command("ls")
def ls(config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """Checkpoints in the store: tag, step, size, complete, time. A refused manifest is marked, with why."""
    from trainer.objstore.backends import UnsafeManifest

    store, _cfg = _store(config)
    infos = store.list()
    try:
        latest = store.latest()
    except UnsafeManifest:  # `latest` names a refused checkpoint: it is marked in the list
        latest = None
    if as_json:
        typer.echo(
            json.dumps(
                [
                    {
                        "tag": i.tag,
                        "step": i.step,
                        "size": i.size,
                        "complete": i.complete,
                        "time": i.time,
                        "world_size": i.world_size,
                        "refused": i.problem,
                    }
                    for i in infos
                ],
                indent=2,
            )
        )
        return
    from provision.cli.views import print_checkpoints

    print_checkpoints(infos, latest)


@app.command("pull")
def pull(
    tag: Annotated[Optional[str], typer.Argument(help="tag (default: latest complete)")] = None,
    config: ConfigOpt = None,
    dest: Annotated[Path, typer.Option("--dest", "-d", help="where the ZeRO checkpoint goes")] = Path("checkpoints"),
    hf: Annotated[Optional[Path], typer.Option("--hf", help="also write a Hugging Face model folder")] = None,
) -> None:
    """Download a checkpoint (verified), optionally as a from_pretrained-ready folder."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    store, cfg = _store(config)
    if hf is not None:
        _say_export_cost(store, tag)
    with Progress(
        "[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(), transient=True
    ) as bar:
        task = bar.add_task("download", total=None)
        info = store.download(tag, dest, progress=lambda done, total: bar.update(task, completed=done, total=total))
    say(f"pulled {info.tag} (step {info.step}, {info.size / 1e6:,.1f} MB) into {dest}")
    if hf is not None:
        _export_hf(dest, info.tag, hf, cfg.train.model, cfg.train.tokenizer)


def _say_export_cost(store: CheckpointStore, tag: str | None) -> None:
    """Before a long download: what --hf will cost here, and the lighter way on the node."""
    from trainer.objstore.backends import StorageError

    try:
        info = store.latest() if tag is None else store.info(tag)
    except (StorageError, ValueError):  # the download below says what is wrong
        return
    if info is None or not info.size:
        return
    params = info.size / 14  # a 16-bit ZeRO save: 2 B/param module + 12 B/param optimizer shards
    say(
        f"--hf: downloads {info.size / 1e9:,.1f} GB, then zero_to_fp32 holds ~{8 * params / 1e9:,.1f} GB in RAM "
        f"here (fp32 partitions + the fp32 state dict). Weights only, on the node instead: `gpuctl ssh`, then "
        f"`python -m trainer.export <run dir>/checkpoints {info.tag} OUT --dtype bf16` "
        f"(~{2 * params / 1e9:,.1f} GB to copy back)"
    )


def _export_hf(dest: Path, tag: str, out: Path, model: str, tokenizer: str | None) -> None:
    """zero_to_fp32 + save_pretrained run in a child python: this process never imports torch.

    The shards are a node's: the child loads them weights-only (trainer/safe_load.py; the variable
    below also makes every torch.load in it weights-only, whatever the caller passes). Its one-line
    error becomes ours; a refusal exits 3. The tokenizer is always named here: the checkpoint's own
    record of it is the node's word."""
    from provision.core.errors import ConfigError, GpuctlError

    probe = "import importlib.util as u, sys; sys.exit(0 if u.find_spec('torch') and u.find_spec('deepspeed') else 1)"
    if subprocess.run([sys.executable, "-c", probe]).returncode != 0:
        raise ConfigError("--hf needs torch and deepspeed here", "pip install 'gpuctl[train]'")
    argv = [sys.executable, "-m", "trainer.export", str(dest), tag, str(out), "--model", model]
    argv += ["--tokenizer", tokenizer or ("bytes" if model == "tiny" else model)]
    env = {k: v for k, v in os.environ.items() if k != "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"}
    env["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    rc, error = _run_passing_stderr(argv, env, "export: error: ")
    if rc == 3:
        raise GpuctlError(
            error or f"checkpoint {tag} was refused",
            f"do not use checkpoint {tag}: gpuctl and DeepSpeed do not write that; delete its folder from the "
            "store and check who can write there",
        )
    if rc == 2 and error:
        raise ConfigError(error, "check train.model and train.tokenizer in gpuctl.yaml against the run that saved it")
    if rc != 0:
        raise ConfigError(f"could not convert {tag} into a Hugging Face folder", "see the lines above")
    say(f"wrote a Hugging Face model folder to {out}")


def _run_passing_stderr(argv: list[str], env: dict[str, str], error_prefix: str) -> tuple[int, str | None]:
    """Run argv; its output goes on to our stderr as it comes (progress bars redraw with a bare CR),
    without control characters (it prints what the shards hold, e.g. their DeepSpeed version), except
    the line starting with ``error_prefix``: returned (without the prefix), with the exit status."""
    error, pending = None, b""
    with subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        for chunk in iter(lambda: os.read(fd, 65536), b""):
            pending += chunk
            cut = max(pending.rfind(b"\n"), pending.rfind(b"\r")) + 1
            done, pending = pending[:cut], pending[cut:]
            for line in done.decode("utf-8", "replace").splitlines(keepends=True):
                line = _CONTROL.sub("", line)
                if line.startswith(error_prefix):
                    error = line[len(error_prefix) :].strip()
                else:
                    sys.stderr.write(line)
            sys.stderr.flush()
        sys.stderr.write(_CONTROL.sub("", pending.decode("utf-8", "replace")))
    return proc.returncode, error

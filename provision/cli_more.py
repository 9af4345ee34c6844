"""CLI wiring for plan, report and ckpt (kept apart so cli.py stays short).

Only typer is imported at module level; each command imports what it uses.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer

ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="gpuctl.yaml (default: ./gpuctl.yaml)")]
ckpt_app = typer.Typer(help="List and pull checkpoints from the run's storage.", no_args_is_help=True)


def _say(text: str) -> None:
    typer.echo(text, err=True)


def _config_or_none(path: Optional[Path]):
    from provision.config import CONFIG_NAME, load_config

    if path is None and not (Path.cwd() / CONFIG_NAME).is_file():
        return None
    return load_config(path)


def plan(config: ConfigOpt = None,
         model: Annotated[Optional[str], typer.Option(help="deepseek-7b, tiny, or an HF id gpuctl knows")] = None,
         gpus: Annotated[Optional[int], typer.Option(help="GPUs per node")] = None,
         nodes: Annotated[Optional[int], typer.Option(help="nodes")] = None,
         gpu: Annotated[Optional[str], typer.Option(help="GPU model, e.g. 'RTX 4090', A100, H100")] = None,
         gpu_mem: Annotated[Optional[float], typer.Option("--gpu-mem", help="GB per GPU")] = None,
         zero_stage: Annotated[Optional[int], typer.Option("--zero-stage")] = None,
         offload: Annotated[Optional[str], typer.Option(help="none | cpu")] = None,
         micro_batch: Annotated[Optional[int], typer.Option("--micro-batch")] = None,
         seq_len: Annotated[Optional[int], typer.Option("--seq-len")] = None,
         checkpointing: Annotated[Optional[bool], typer.Option("--checkpointing/--no-checkpointing")] = None,
         precision: Annotated[Optional[str], typer.Option(help="fp16 | bf16 | fp32")] = None,
         as_json: Annotated[bool, typer.Option("--json", help="figures for scripts")] = False) -> None:
    """GPU memory per rank, host RAM, fits or not, the closest config that fits, tokens/s."""
    from provision.errors import ConfigError
    from provision.plan import PlanError, PlanInput, plan_to_json, render_plan_table
    from provision.plan import plan as run_plan

    cfg = _config_or_none(config)
    base = _plan_defaults(cfg)
    flags = dict(model=model, gpus_per_node=gpus, nodes=nodes, gpu=gpu, gpu_mem_gb=gpu_mem,
                 zero_stage=zero_stage, offload_optimizer=offload, micro_batch=micro_batch,
                 seq_len=seq_len, gradient_checkpointing=checkpointing, precision=precision)
    base.update({k: v for k, v in flags.items() if v is not None})
    try:
        result = run_plan(PlanInput(**base))
    except PlanError as exc:
        raise ConfigError(str(exc), "fix the flag or gpuctl.yaml value it names") from None
    if as_json:
        typer.echo(json.dumps(plan_to_json(result), indent=2))
        return
    from rich.console import Console

    Console().print(render_plan_table(result))


def _plan_defaults(cfg) -> dict:
    """The run's own gpuctl.yaml as plan input; DeepSeek-7B on 3x RTX 4090 without one."""
    if cfg is None:
        return {}
    prov, train = cfg.provider, cfg.train
    gpus = getattr(prov, "gpus_per_node", None) or getattr(prov, "cpu_ranks", None) or 1
    out = dict(model=train.model, gpus_per_node=gpus, nodes=getattr(prov, "nodes", None) or
               len(getattr(prov, "hosts", []) or [1]), zero_stage=train.zero_stage,
               offload_optimizer=train.offload_optimizer, micro_batch=train.micro_batch,
               seq_len=train.seq_len, gradient_checkpointing=train.gradient_checkpointing,
               precision=train.precision)
    if getattr(prov, "gpu", None):
        out["gpu"] = prov.gpu
    return out


def report(runs: Annotated[Optional[list[str]], typer.Argument(help="run ids (default: the newest)")] = None,
           baseline: Annotated[Optional[str], typer.Option(help="1-GPU run id for scaling efficiency")] = None,
           output: Annotated[Path, typer.Option("--output", "-o", help="folder for report.md and report.png")]
           = Path("gpuctl-report")) -> None:
    """A Markdown table like the seed article's and a PNG of loss and tokens/s over steps."""
    from provision import job, state
    from provision.errors import GpuctlError
    from provision.report import ReportError, RunReportInput, load_run_metrics, report_markdown, report_png

    def report_input(run_id: str | None) -> RunReportInput:
        record = state.load_run(run_id)
        metrics = load_run_metrics(job.fetch_results(record))
        gpus = record.world_size if record.accelerator == "cuda" else 0
        return RunReportInput(metrics=metrics, world_size=record.world_size, gpus=gpus,
                              micro_batch=record.micro_batch, grad_accum=record.grad_accum,
                              train_batch_size=record.train_batch_size)

    try:
        inputs = [report_input(r) for r in (runs or [None])]
        base = report_input(baseline) if baseline else None
        output.mkdir(parents=True, exist_ok=True)
        markdown = report_markdown(inputs, baseline=base)
        (output / "report.md").write_text(markdown)
        png = report_png(inputs + ([base] if base else []), output / "report.png")
    except ReportError as exc:
        raise GpuctlError(str(exc), "let the run log a few steps, or name a run with metrics") from None
    typer.echo(markdown)
    _say(f"wrote {output / 'report.md'} and {png}")


def _store(config: Optional[Path]):
    from provision.config import load_config
    from trainer.objstore import CheckpointStore

    cfg = load_config(config)
    storage = cfg.storage.model_dump()
    storage["url"] = cfg.storage_url()
    return CheckpointStore.from_config(storage, log=_say), cfg


@ckpt_app.command("ls")
def ckpt_ls(config: ConfigOpt = None, as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Checkpoints in the store: tag, step, size, complete, time."""
    import time

    store, _cfg = _store(config)
    infos = store.list()
    if as_json:
        typer.echo(json.dumps([{"tag": i.tag, "step": i.step, "size": i.size, "complete": i.complete,
                                "time": i.time, "world_size": i.world_size} for i in infos], indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    latest = store.latest()
    table = Table("tag", "step", "size", "complete", "time", "ranks")
    for i in infos:
        mark = " (latest)" if latest and latest.tag == i.tag else ""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i.time)) if i.time else "-"
        table.add_row(i.tag + mark, str(i.step), f"{i.size / 1e6:,.1f} MB", "yes" if i.complete else "no",
                      when, str(i.world_size or "-"))
    Console().print(table if infos else "no checkpoints yet")


@ckpt_app.command("pull")
def ckpt_pull(tag: Annotated[Optional[str], typer.Argument(help="tag (default: latest complete)")] = None,
              config: ConfigOpt = None,
              dest: Annotated[Path, typer.Option("--dest", "-d", help="where the ZeRO checkpoint goes")]
              = Path("checkpoints"),
              hf: Annotated[Optional[Path], typer.Option("--hf", help="also write a Hugging Face model folder")]
              = None) -> None:
    """Download a checkpoint (verified), optionally as a from_pretrained-ready folder."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    store, cfg = _store(config)
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), transient=True) as bar:
        task = bar.add_task("download", total=None)
        info = store.download(tag, dest, progress=lambda done, total: bar.update(task, completed=done, total=total))
    _say(f"pulled {info.tag} (step {info.step}, {info.size / 1e6:,.1f} MB) into {dest}")
    if hf is not None:
        _export_hf(dest, info.tag, hf, cfg.train.model, cfg.train.tokenizer)


def _export_hf(dest: Path, tag: str, out: Path, model: str, tokenizer: str | None) -> None:
    """zero_to_fp32 + save_pretrained run in a child python: this process never imports torch."""
    from provision.errors import ConfigError

    probe = "import importlib.util as u, sys; sys.exit(0 if u.find_spec('torch') and u.find_spec('deepspeed') else 1)"
    if subprocess.run([sys.executable, "-c", probe]).returncode != 0:
        raise ConfigError("--hf needs torch and deepspeed here", "pip install 'gpuctl[train]'")
    argv = [sys.executable, "-m", "trainer.export", str(dest), tag, str(out), "--model", model]
    if tokenizer:
        argv += ["--tokenizer", tokenizer]
    if subprocess.run(argv).returncode != 0:
        raise ConfigError(f"could not convert {tag} into a Hugging Face folder", "see the lines above")
    _say(f"wrote a Hugging Face model folder to {out}")


def register(app: typer.Typer, handled: Callable[[Callable], Callable]) -> None:
    app.command()(handled(plan))
    app.command()(handled(report))
    for command in ckpt_app.registered_commands:
        command.callback = handled(command.callback)
    app.add_typer(ckpt_app, name="ckpt")

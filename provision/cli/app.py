"""The gpuctl command line: one Typer app made of the command groups, behind one error boundary.

Each group module holds its commands; heavy modules (boto3, paramiko, jinja2, pydantic models)
are imported inside the commands so `gpuctl --help` stays fast.
"""

from __future__ import annotations

import sys

import typer

from provision.cli import boundary, ckpt, cluster, doctor, image, jobs, plan, report

app = typer.Typer(
    help="Rent a few GPUs, train with DeepSpeed, sync checkpoints, tear down.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    # Plain help: typer's rich help imports rich.markdown (markdown-it) and costs ~0.1 s of every
    # `--help` and usage error (issue 37); the command views still draw with rich.
    rich_markup_mode=None,
)
app.add_typer(cluster.app)
app.add_typer(jobs.app)
app.add_typer(plan.app)
app.add_typer(report.app)
app.add_typer(doctor.app)
app.add_typer(image.app, name="image")
app.add_typer(ckpt.app, name="ckpt")
boundary.guard_all(app)


def main() -> None:
    from provision.core import interrupt

    interrupt.install()  # a Ctrl-C is recorded too, so one that a finalizer swallowed still stops gpuctl
    try:
        app()
    except KeyboardInterrupt:  # typer turns one into exit 130 itself; this is for what escapes it
        typer.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()

"""Entry point: `python -m trainer run.json` (one process per rank, cwd = the run dir).

Exit codes: 0 done (summary.json state succeeded), 75 saved and stopped early on the stop signal
(trainer/stop_signal.py), 2 a known problem (one clear line on
stderr: bad config, world-size mismatch, storage), 1 anything else (traceback, then a line).
"""

from __future__ import annotations

import sys
from pathlib import Path

from trainer import secrets_file, stop_signal
from trainer.config import DistEnv, RunConfig, TrainerError, load_run_config


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m trainer run.json", file=sys.stderr)
        return 2
    run_json = Path(argv[0])
    env, cfg = DistEnv.from_env(), None
    run_dir = run_json.resolve().parent
    try:
        secrets_file.load(run_dir)  # first: the run's secrets reach this rank only this way (see there)
        cfg = load_run_config(run_json)
        env = DistEnv.from_env(cfg.num_nodes, cfg.shared_dir)
        stop = stop_signal.install()  # before the slow imports: a walltime warning may come early
        prepare_process(env)  # before torch loads: OpenMP and the pinned allocator read the env once
        # heavy imports (torch, deepspeed) only once the config is sound
        from trainer import loop

        summary = loop.train(cfg, env, stop)
        loop.finish(cfg, env, summary)
        # Rank 0 alone says "stopped": DeepSpeed's launcher kills every rank once one exits non-zero,
        # and rank 0 ends last (its node's uploads, then summary.json), so no rank loses its work.
        return stop_signal.EXIT_CODE if summary["state"] == "stopped" and env.is_main else 0
    except TrainerError as exc:
        if env.is_main or not exc.everywhere:
            where = "" if env.is_main else f" (rank {env.rank})"
            print(f"trainer: error{where}: {exc}", file=sys.stderr, flush=True)
            _record_failure(cfg, run_json, env, str(exc))
        return 2
    except Exception as exc:  # the one top-level catch: record the failure, keep the traceback
        _record_failure(cfg, run_json, env, f"{type(exc).__name__}: {exc}")
        raise
    finally:
        secrets_file.drop(run_dir, env)  # this rank is done; a run that failed early leaves no secrets file


def prepare_process(env: DistEnv) -> None:
    """CPU threads and core binding for this rank, no torch.compile, exact-size pinning where torch has it
    (trainer.hostenv, trainer.pinning); one line per rank says what it got."""
    from trainer import hostenv, pinning

    hostenv.env_tools_first()  # the environment's own ninja builds DeepSpeed's ops (see there)
    hostenv.no_compiler()
    hostenv.cpu_info_once()
    threads = hostenv.bind_threads()
    pinning.pin_env()
    if threads:
        print(f"trainer: rank {env.rank} (local {env.local_rank}): {threads}", flush=True)


def _record_failure(cfg: RunConfig | None, run_json: Path, env: DistEnv, message: str) -> None:
    if not env.is_main:
        return
    from trainer.metrics import write_summary

    run_dir = cfg.run_dir if cfg else run_json.resolve().parent
    if run_dir.is_dir():
        write_summary(run_dir, {"state": "failed", "run_id": cfg.run_id if cfg else None, "error": message})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

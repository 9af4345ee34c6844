"""The budget cap against the predicted time to max_steps (provision/estimate/forecast.py check_cap): `up`
warns when the cap may stop the run, `train` warns too, and refuses (unless --force) a run whose low end
already passes the cap, before anything starts on the node.

The fake Vast.ai API's instance is the loopback sshd (3 CPU ranks, the tiny model); no run trains here: the
refusal comes before any rank, and the warned run's DeepSpeed launcher is a bash stand-in.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from provision.cli.app import app
from provision.core import state
from provision.core.config import GpuctlConfig, load_config
from provision.core.errors import GpuctlError
from provision.core.provider_config import VastProvider
from provision.estimate.forecast import check_cap, cluster_model
from provision.flows import cluster
from provision.providers.base import UpOptions
from tests.fakes.guards import kill_guards
from tests.fakes.harness import node_fields, serve_vast, write_config
from tests.test_budget_guard import stand_in_runs

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def vast(sshd, monkeypatch, project):
    yield from serve_vast(sshd, monkeypatch)
    kill_guards(project)  # `up` started the cap's guard on the stand-in node (this machine)


def set_steps(project: Path, steps: int) -> None:
    path = project / "gpuctl.yaml"
    cfg = yaml.safe_load(path.read_text())
    cfg["train"]["max_steps"] = steps
    path.write_text(yaml.safe_dump(cfg))


def test_up_warns_and_train_refuses_a_run_the_cap_stops_then_warns_one_it_may_stop(
    project, vast, state_dir, monkeypatch
):
    # $1.05/h (the fake's offer): max_cost 1.05 is a 1 h cap, below max_hours; 10M steps take days
    fields = {"kind": "vast", "api_url": vast.url, "max_hours": 6, "max_cost": 1.05, **node_fields(project)}
    write_config(project, fields, name="capped", max_steps=10_000_000)
    said: list[str] = []
    record = cluster.up(load_config(project / "gpuctl.yaml"), UpOptions(assume_yes=True, say=said.append))
    try:
        warned = [i for i, s in enumerate(said) if s.startswith("warning: the run cannot finish before the budget cap")]
        checks = next(i for i, s in enumerate(said) if s.startswith("quick checks:"))
        # said before renting (the offer's GPUs, plan's tables) and again after the quick checks (the node)
        assert len(warned) == 2 and warned[0] < checks < warned[1], said
        assert all("provider.max_cost $1.05 ($1.050/h: 60 min)" in said[i] for i in warned), said
        warned = [said[i] for i in warned]
        assert "10,000,000 steps are predicted to take" in warned[0] and "lower train.max_steps to " in warned[0]

        refused = CliRunner().invoke(app, ["train"])
        assert refused.exit_code == 1, refused.output
        error = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
        assert len(error) == 1 and "the run cannot finish before the budget cap: provider.max_cost" in error[0]
        assert "(fix: lower train.max_steps to " in error[0] and "or raise provider.max_cost then" in error[0]
        assert error[0].endswith("--force trains anyway)")
        assert "Traceback" not in refused.output
        # nothing started: no run recorded, no run folder on the node, no prediction kept
        assert not list(state_dir.glob("runs/*.json")) and not (project / "node" / "runs").exists()
        assert not (state_dir / "results").exists() and vast.instances

        # a max_steps whose predicted range straddles the cap: warned, and the run starts
        cfg = load_config(project / "gpuctl.yaml")
        model = cluster_model(cfg, state.load_cluster("capped"))
        assert model is not None
        left = record.created_at + record.budget_hours * 3600 - time.time()
        set_steps(project, int(left / model.step_s))
        stand_in_runs(monkeypatch, "exit 0")
        warned_run = CliRunner().invoke(app, ["train", "--detach"])
        assert warned_run.exit_code == 0, warned_run.output
        assert "warning: the budget cap may stop the run before its end: provider.max_cost" in warned_run.stderr
        assert len(list(state_dir.glob("runs/*.json"))) == 1
    finally:
        cluster.down(record.name, say=lambda _: None)


def test_a_cap_past_the_high_end_says_nothing_and_a_resumed_run_is_only_warned():
    cfg = GpuctlConfig(provider=VastProvider(max_hours=2))
    node = state.NodeRecord(host="n0", slots=3, accelerator="cpu")
    record = state.ClusterRecord(name="c", provider="vast", nodes=[node], budget_hours=2.0, created_at=time.time())
    cfg.train.model, cfg.train.max_steps = "tiny", 10
    model = cluster_model(cfg, record)
    assert model is not None
    said: list[str] = []
    check_cap(cfg, record, model, said.append, refuse=True)
    assert said == []
    cfg.train.max_steps = int(3 * 7200 / model.fast_s)  # the low end alone is 3 caps
    with pytest.raises(GpuctlError, match=r"cannot finish before the budget cap: provider.max_hours 2 h"):
        check_cap(cfg, record, model, said.append, refuse=True)
    check_cap(cfg, record, model, said.append, refuse=False)  # `up`, or `train --resume`/`--force`
    assert len(said) == 1 and said[0].startswith("warning: the run cannot finish before the budget cap")
    record.budget_hours = None  # local, ssh: no cap
    check_cap(cfg, record, model, said.append, refuse=True)
    assert len(said) == 1

"""Data parallelism is exact: 3 ranks x grad_accum 4 == 1 rank x grad_accum 12 (real DeepSpeed, CPU, gloo)."""

from __future__ import annotations

import pytest

from tests import test_trainer_helpers as h

pytest.importorskip("deepspeed")

STEPS = 3


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_three_ranks_match_one_rank(tmp_path):
    runs = {}
    for world, grad_accum in ((3, 4), (1, 12)):
        run_dir = h.make_run_dir(tmp_path / f"w{world}", world=world, grad_accum=grad_accum, max_steps=STEPS)
        proc = h.launch(run_dir, world)
        assert proc.returncode == 0, proc.stdout[-3000:]
        runs[world] = h.losses(run_dir)
        assert h.summary(run_dir)["world_size"] == world
    assert sorted(runs[3]) == sorted(runs[1]) == list(range(1, STEPS + 1))
    for step in runs[1]:
        assert runs[3][step] == pytest.approx(runs[1][step], abs=1e-5), (step, runs)
    assert runs[1][STEPS] < runs[1][1]  # and it learns

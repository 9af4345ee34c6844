"""Plan's save term against a real DeepSpeed ZeRO-2 save on 2 CPU ranks (tiny model, offload cpu, fp32).

On GPUs rank 0's torch.save brings every storage of the module state dict to the host, one storage at a
time (torch/serialization.py _save: `storage.cpu()`); ZeRO-2's module parameters are views of one flat
weight buffer, so the one storage is the whole buffer: plan's "module states copied to host at save".
Here, what the engine really hands torch.save is measured: the largest storage behind its module state dict
(the block a GPU save copies in one piece) must equal the term. CPU ranks hold that buffer in host RAM
already, so their save's peak RSS rise (VmHWM, reset just before) must stay below the term: this machine
cannot show the device-to-host copy itself, only its size."""

from __future__ import annotations

import json
import textwrap

import pytest

from provision.estimate.hardware import GB
from provision.estimate.node import node_requirements, save_term
from provision.estimate.plan_input import PlanInput
from tests import test_trainer_helpers as h

MEASURE = textwrap.dedent("""
    import json, sys
    import deepspeed, torch
    from trainer.config import TrainConfig
    from trainer.model import build_model
    from trainer.tokenizer import load_tokenizer

    deepspeed.init_distributed(dist_backend="gloo")
    def status(key):
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))
    train = TrainConfig(seq_len=64, offload_optimizer="cpu")
    model = build_model(train, "fp32", load_tokenizer(train))
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=list(model.parameters()), config=json.load(open(sys.argv[1]))
    )
    ids = torch.randint(0, 259, (1, 64))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in engine.module_state_dict().values() if torch.is_tensor(t)}
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
    before = status("VmRSS:")
    engine.save_checkpoint(sys.argv[2], tag="t")
    rise = status("VmHWM:") - before
    print("MEASURED", json.dumps({"rank": engine.global_rank, "largest": max(storages.values()), "rise": rise}))
""")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_save_term_is_the_storage_rank_0_hands_torch_save(tmp_path):
    (tmp_path / "measure.py").write_text(MEASURE)
    (tmp_path / "ds.json").write_text(json.dumps(h.ds_config(1, 1, 2, "fp32", True, 1e-3)))
    out = h.torchrun(tmp_path, 2, str(tmp_path / "measure.py"), str(tmp_path / "ds.json"), str(tmp_path / "ckpt"))
    ranks = {
        r["rank"]: r
        for r in (json.loads(line.split("MEASURED ", 1)[1]) for line in out.splitlines() if "MEASURED " in line)
    }
    inp = PlanInput(model="tiny", gpus_per_node=2, precision="fp32", grad_accum=1, seq_len=64)
    term = save_term(inp)
    assert ranks[0]["largest"] / GB == pytest.approx(term.gb, rel=0.01), (ranks, term)
    assert ranks[0]["rise"] / GB < term.gb, ranks  # host-resident weights: written in place, no copy
    req = node_requirements(inp)
    assert term.name in {t.name for t in req.save} and req.ram_gb >= req.save_gb + req.reserve_gb

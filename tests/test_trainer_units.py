"""Fast trainer tests (no DeepSpeed ranks): data order and sharding, tokenizer, config, metrics, checkpoints."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from trainer.checkpoint import Checkpointer, check_compatible, locate_local
from trainer.config import DistEnv, TrainerError, parse_run_config
from trainer.dataset import (
    PackedTokens,
    Sampler,
    cache_path,
    iter_documents,
    micro_slice,
    resolve_data,
    tokenize_to_file,
)
from trainer.metrics import peak_tflops, throughput
from trainer.tokenizer import byte_tokenizer

GLOBAL = 12


# -- data order ---------------------------------------------------------------------------------
def rank_major_batch(sampler: Sampler, position: int, world: int, micro_batch: int) -> list[int]:
    """What all ranks train on in one step, gathered the way the loop slices it."""
    grad_accum = GLOBAL // (world * micro_batch)
    batch = sampler.global_batch(position, GLOBAL)
    taken = [micro_slice(batch, r, m, world, micro_batch) for m in range(grad_accum) for r in range(world)]
    return [int(i) for part in taken for i in part]


@pytest.mark.parametrize("world,micro_batch", [(1, 1), (3, 1), (2, 2), (4, 3), (6, 1), (12, 1), (1, 12)])
def test_global_batch_is_the_same_for_any_split(world, micro_batch):
    sampler = Sampler(num_samples=100, seed=7)
    for step in range(30):  # crosses several epochs
        position = step * GLOBAL
        got = rank_major_batch(sampler, position, world, micro_batch)
        assert got == list(sampler.global_batch(position, GLOBAL))  # disjoint slices, in order, all of it
        assert got == list(Sampler(100, 7).global_batch(position, GLOBAL))  # deterministic from the seed


def test_each_epoch_visits_every_sample_once_and_orders_differ():
    sampler = Sampler(num_samples=50, seed=3)
    epoch0, epoch1 = sampler.global_batch(0, 50), sampler.global_batch(50, 50)
    assert sorted(epoch0) == sorted(epoch1) == list(range(50))
    assert list(epoch0) != list(epoch1)
    assert Counter(sampler.global_batch(0, 150).tolist()) == Counter({i: 3 for i in range(50)})
    assert list(Sampler(50, 4).global_batch(0, 50)) != list(epoch0)


def test_resume_position_continues_the_same_order():
    full = Sampler(37, 11).global_batch(0, 12 * 10)
    later = Sampler(37, 11).global_batch(12 * 4, 12 * 6)  # a fresh process resuming at step 4
    assert list(later) == list(full[12 * 4 :])


# -- tokenizer ----------------------------------------------------------------------------------
def test_byte_tokenizer_round_trip_and_save(tmp_path):
    from transformers import AutoTokenizer

    tok = byte_tokenizer()
    text = "alice has 3 apples.\n\t37 * 2 = 74  ünïcödé 日本語 🙂 </s> <s>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[:5] == list(b"alice")
    assert tok.decode(ids) == text
    assert len(tok) == 259 and (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (256, 257, 258)
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(text, add_special_tokens=False)["input_ids"] == ids
    assert again.decode(ids) == text and again.eos_token_id == 257


# -- data files ---------------------------------------------------------------------------------
def test_tokenize_pack_txt_and_jsonl(tmp_path):
    tok = byte_tokenizer()
    (tmp_path / "a.txt").write_text("ab\n\ncd\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "ab"}) + "\n" + json.dumps({"text": "cd"}) + "\n")
    for name in ("a.txt", "b.jsonl"):
        source = resolve_data(name, tmp_path)
        assert list(iter_documents(source)) == ["ab", "cd"]
        out = cache_path(source, tok, tmp_path / "cache")
        tokenize_to_file(source, tok, out, lambda _m: None)
        packed = PackedTokens(out, len(tok), seq_len=2)  # blocks of 3 tokens
        assert packed.num_samples == 2
        inputs, targets = packed.batch(np.array([1, 0]))
        eos = tok.eos_token_id
        assert inputs.tolist() == [[ord("c"), ord("d")], [ord("a"), ord("b")]]
        assert targets.tolist() == [[ord("d"), eos], [ord("b"), eos]]


def test_parquet_text_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["ab", None, "cd"], "id": [1, 2, 3]}), tmp_path / "d.parquet")
    assert list(iter_documents(resolve_data("d.parquet", tmp_path))) == ["ab", "cd"]
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "e.parquet")
    with pytest.raises(TrainerError, match='no "text" column'):
        list(iter_documents(tmp_path / "e.parquet"))


def test_sample_data_and_clear_data_errors(tmp_path, monkeypatch):
    assert resolve_data("sample", tmp_path).stat().st_size > 50_000
    with pytest.raises(TrainerError, match="no such file"):
        resolve_data("missing.txt", tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"text": 1}\n')
    with pytest.raises(TrainerError, match="bad.jsonl:1"):
        list(iter_documents(tmp_path / "bad.jsonl"))
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(TrainerError, match="needs pyarrow"):
        list(iter_documents(resolve_data("d.parquet", tmp_path)))
    (tmp_path / "tiny.txt").write_text("x\n")
    tok = byte_tokenizer()
    out = tmp_path / "t.bin"
    tokenize_to_file(tmp_path / "tiny.txt", tok, out, lambda _m: None)
    with pytest.raises(TrainerError, match="fewer than one sample"):
        PackedTokens(out, len(tok), seq_len=64)


# -- config -------------------------------------------------------------------------------------
def test_run_config_validation(tmp_path):
    raw = {"ds_config": "ds.json", "train": {"max_steps": 5, "lr": 1, "new_knob": 3}, "extra": 1}
    cfg = parse_run_config(raw, tmp_path)
    assert cfg.train.max_steps == 5 and cfg.train.lr == 1.0 and cfg.resume is None and cfg.num_nodes == 1
    assert cfg.warnings == ("run.json: ignoring unknown key train.new_knob", "run.json: ignoring unknown key extra")
    for bad, match in [
        ({"max_steps": "5"}, "integer"),
        ({"max_steps": 0}, ">= 1"),
        ({"precision": "fp8"}, "precision"),
        ({"gradient_checkpointing": 1}, "true or false"),
    ]:
        with pytest.raises(TrainerError, match=match):
            parse_run_config({"ds_config": "ds.json", "train": bad}, tmp_path)


def test_dist_env_node_rank(monkeypatch):
    monkeypatch.setenv("RANK", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("LOCAL_SIZE", "3")
    env = DistEnv.from_env(num_nodes=2)
    assert (env.node_rank, env.is_main, env.is_dir_main) == (1, False, False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "3")  # node 1's first rank: its own run dir's main, not a shared one's
    assert DistEnv.from_env(num_nodes=2).is_dir_main and not DistEnv.from_env(2, shared_dir=True).is_dir_main
    monkeypatch.setenv("RANK", "0")
    assert DistEnv.from_env(2, shared_dir=True).is_dir_main


def test_shared_dir_is_a_bool(tmp_path):
    base = {"ds_config": "ds.json", "train": {}}
    assert parse_run_config({**base, "shared_dir": True}, tmp_path).shared_dir
    assert not parse_run_config(base, tmp_path).shared_dir
    with pytest.raises(TrainerError, match="shared_dir must be true or false"):
        parse_run_config({**base, "shared_dir": "yes"}, tmp_path)


# -- metrics ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,peak",
    [
        ("NVIDIA GeForce RTX 4090", 165.2),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA A10G", 125.0),
        ("NVIDIA L40S", None),
        (None, None),
    ],
)
def test_peak_table(name, peak):
    assert peak_tflops(name) == peak


def test_mfu_arithmetic():
    # DeepSeek-7B-sized: 6.9e9 params, 3 x 4090 at 2,400 tok/s -> 33 TFLOP/s per GPU, 20% MFU
    rate = throughput(tokens=2400, seconds=1.0, params=int(6.9e9), world_size=3, peak=165.2)
    assert rate.tflops_per_gpu == pytest.approx(33.12)
    assert rate.mfu == pytest.approx(33.12 / 165.2)
    assert throughput(100, 1.0, 1000, 1, None).mfu is None


# -- checkpoints --------------------------------------------------------------------------------
def _fake_tag(root: Path, tag: str, world: int | None) -> None:
    (root / tag).mkdir(parents=True)
    (root / tag / "mp_rank_00_model_states.pt").write_bytes(b"")
    if world:
        (root / tag / "trainer_state.json").write_text(json.dumps({"world_size": world}))


def test_locate_and_world_size_check(tmp_path):
    _fake_tag(tmp_path, "step3", world=3)
    (tmp_path / "latest").write_text("step3\n")
    assert locate_local(tmp_path) == (tmp_path, "step3")
    assert locate_local(tmp_path / "step3") == (tmp_path, "step3")
    with pytest.raises(TrainerError, match="not a DeepSpeed save dir"):
        locate_local(tmp_path / "nope")
    check_compatible(tmp_path / "step3", DistEnv(0, 0, 3, 3))
    with pytest.raises(TrainerError, match="saved by 3 ranks but this run has 2"):
        check_compatible(tmp_path / "step3", DistEnv(0, 0, 2, 2))


class _Uploader:
    def __init__(self, done: set[str], superseded: tuple[str, ...] = ()):
        self.done, self.superseded = done, superseded

    def uploaded_tags(self) -> set[str]:
        return self.done

    def superseded_tags(self) -> list[str]:
        return list(self.superseded)


def test_local_retention_keeps_newest_and_unuploaded(tmp_path):
    cfg = parse_run_config({"ds_config": "ds.json", "train": {"keep_local": 2}}, tmp_path)
    ckpt = Checkpointer(None, cfg, DistEnv(0, 0, 1, 1), None, lambda _m: None)
    for step in (5, 10, 15, 20):
        _fake_tag(ckpt.dir, f"step{step}", world=1)

    def left() -> list[str]:
        return sorted((p.name for p in ckpt.dir.iterdir()), key=lambda n: int(n[4:]))

    ckpt.uploader = _Uploader({"step5", "step10"})  # step15, step20 still uploading
    ckpt.prune()
    assert left() == ["step15", "step20"]
    _fake_tag(ckpt.dir, "step25", world=1)
    ckpt.prune()
    assert left() == ["step15", "step20", "step25"]  # step15 is not in the store yet: kept
    ckpt.uploader = _Uploader({"step5", "step10", "step20"})  # step15's upload failed, step20 is up
    ckpt.prune()
    assert left() == ["step20", "step25"]
    _fake_tag(ckpt.dir, "step27", world=1)
    ckpt.prune()
    assert left() == ["step25", "step27"]  # step25's upload still runs: step20 goes (in the store)
    _fake_tag(ckpt.dir, "step28", world=1)
    ckpt.uploader = _Uploader({"step20"}, superseded=("step25",))  # step25 never goes up: a newer save did
    ckpt.prune()
    assert left() == ["step27", "step28"]
    ckpt.uploader = None  # no object storage: plain retention
    _fake_tag(ckpt.dir, "step30", world=1)
    ckpt.prune()
    assert left() == ["step28", "step30"]

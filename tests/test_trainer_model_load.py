"""Loading an HF model from a local folder in fp16 never materialises an fp32 copy of the weights.

How it is measured: every torch.nn.Parameter constructed while the trainer's loader runs is
recorded (dtype, device, bytes). transformers builds the model on the meta device and then
creates the real parameters from the checkpoint; a loader that passes the training dtype gets
fp16 parameters straight away, while one that loads in fp32 and casts afterwards (the
`from_pretrained(path).half()` mistake) creates a full set of real fp32 parameters first. The
second test runs that broken loader through the same detector and checks that it is caught.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch
import transformers

from trainer import model as trainer_model
from trainer.config import TrainConfig

pytestmark = pytest.mark.timeout(120)

VOCAB = 300


class _Tokenizer:  # build_model only asks a tokenizer for its length
    def __len__(self) -> int:
        return VOCAB


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)  # fp32 on disk
    assert list(path.glob("*.safetensors"))
    return path


def fp32_bytes_materialised(load) -> tuple[torch.nn.Module, int, int]:
    """Run load(); return (model, bytes of real fp32 Parameters created, fp32 size of the model)."""
    created: list[tuple[torch.dtype, str, int]] = []
    original = torch.nn.Parameter.__new__

    def recording_new(cls, data=None, requires_grad=True):
        if data is not None:
            created.append((data.dtype, data.device.type, data.numel() * data.element_size()))
        return original(cls, data, requires_grad)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.Parameter, "__new__", recording_new)
        loaded = load()
    fp32 = sum(size for dtype, device, size in created if dtype == torch.float32 and device != "meta")
    full_fp32 = sum(p.numel() for p in loaded.parameters()) * 4
    assert created, "the detector saw no Parameter being created: it measures nothing"
    return loaded, fp32, full_fp32


def test_fp16_load_from_folder_holds_no_fp32_copy(model_dir, monkeypatch):
    train = TrainConfig(model=str(model_dir), precision="fp16")
    model, fp32, full = fp32_bytes_materialised(lambda: trainer_model.build_model(train, "fp16", _Tokenizer()))
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes and set(dtypes.values()) == {torch.float16}, dtypes
    assert fp32 == 0, f"{fp32} bytes of fp32 parameters materialised while loading (full fp32 model: {full})"


def test_detector_catches_fp32_then_half_loader(model_dir, monkeypatch):
    """The check above would fail for a loader that loads in fp32 and casts afterwards."""

    def broken(source, dtype):
        return transformers.AutoModelForCausalLM.from_pretrained(source).to(dtype)

    monkeypatch.setattr(trainer_model, "pretrained_model", broken)
    train = TrainConfig(model=str(model_dir), precision="fp16")
    model, fp32, full = fp32_bytes_materialised(lambda: trainer_model.build_model(train, "fp16", _Tokenizer()))
    assert {p.dtype for p in model.parameters()} == {torch.float16}  # the end state alone looks fine...
    assert fp32 >= full  # ...but a whole fp32 copy was held on the way

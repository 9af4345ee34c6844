"""A checkpoint comes from a node, and a node can write any bytes into it: `gpuctl ckpt pull --hf` (and
`python -m trainer.export` on its own) never runs what a shard's pickle names. Real checkpoints from
one-rank DeepSpeed ZeRO-2 (CPU offload) and FSDP runs, one file made hostile, pulled through a file://
store: the file the pickle would write never appears, the command exits non-zero with one line naming
the file and the global. A good checkpoint still exports."""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import test_trainer_helpers as h
from tests.helpers import REPO
from tests.test_fsdp_e2e import torchrun
from trainer.objstore.store import CheckpointStore

TAG = "step2"
MODEL_STATES, OPTIM_STATES = "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"


class RunsACommand:
    """Unpickling it runs `touch MARKER` (a shell command: anything)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class WritesAFile:
    """Unpickling it writes MARKER through a method of a stdlib class."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.write_text, (pathlib.Path(self.marker), "pwned"))


# and the globals each pickle names (protocol 2, torch.save's: a method is getattr(class, name))
PAYLOADS = {
    "os.system": (RunsACommand, "posix.system"),
    "Path.write_text": (WritesAFile, "builtins.getattr, pathlib.Path, pathlib.PosixPath"),
}


def real_run(root: Path, strategy: str) -> Path:
    """The checkpoint folder of a real one-rank run of the tiny model, two steps, saved at step 2."""
    run_dir = h.make_run_dir(
        root, world=1, grad_accum=1, max_steps=2, checkpoint_every=2, offload=strategy == "deepspeed", strategy=strategy
    )
    proc = (h.launch if strategy == "deepspeed" else torchrun)(run_dir, 1)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return run_dir / "checkpoints"


@pytest.fixture(scope="module")
def zero_ckpt(tmp_path_factory) -> Path:
    return real_run(tmp_path_factory.mktemp("zero") / "run", "deepspeed")


@pytest.fixture(scope="module")
def dcp_ckpt(tmp_path_factory) -> Path:
    return real_run(tmp_path_factory.mktemp("fsdp") / "run", "fsdp")


def copy_tag(ckpt_root: Path, to: Path) -> Path:
    shutil.copytree(ckpt_root / TAG, to / TAG)
    return to / TAG


def poison_shard(tag_dir: Path, name: str, payload: object) -> None:
    """The real shard with one more entry, deep in its dict, that runs code when unpickled."""
    import torch

    state = torch.load(tag_dir / name, map_location="cpu", weights_only=False)  # our own run's file
    target = state["optimizer_state_dict"] if "optimizer_state_dict" in state else state
    target["extra"] = {"nested": [payload]}
    torch.save(state, tag_dir / name)


def export(ckpt_root: Path, out: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "trainer.export", str(ckpt_root), TAG, str(out), "--model", "tiny"]
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=300, cwd=REPO, env={**h.rank_env(), **(env or {})}
    )


def pull_hf(project: Path, gpuctl, tag_dir: Path) -> subprocess.CompletedProcess:
    """Publish ``tag_dir`` to a file:// store as a node would, then `gpuctl ckpt pull TAG --hf hf`."""
    store = CheckpointStore.from_config({"url": (project / "store").as_uri()})
    store.upload_shards(tag_dir, TAG, 0, step=2)
    assert store.publish(TAG, 2, world_size=1, num_nodes=1, timeout=5)
    (project / "gpuctl.yaml").write_text("storage: {url: ./store}\n")
    return gpuctl("ckpt", "pull", TAG, "--dest", "pulled", "--hf", "hf", env=h.rank_env(), timeout=300)


def one_error(out: subprocess.CompletedProcess, prefix: str = "error: ") -> str:
    assert out.returncode != 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "Traceback" not in out.stdout + out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith(prefix)]
    assert len(errors) == 1, out.stderr[-3000:]
    return errors[0]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("name", "payload"), [(MODEL_STATES, "os.system"), (OPTIM_STATES, "Path.write_text")])
def test_ckpt_pull_hf_never_runs_a_poisoned_zero_shard(zero_ckpt, project, gpuctl, tmp_path, name, payload):
    cls, global_name = PAYLOADS[payload]
    marker = tmp_path / "pwned"
    tag_dir = copy_tag(zero_ckpt, tmp_path / "node")
    poison_shard(tag_dir, name, cls(marker))

    out = pull_hf(project, gpuctl, tag_dir)
    line = one_error(out)
    assert (
        f"checkpoint {TAG}: {name} holds a pickled object outside the allowlist (GLOBAL {global_name}); "
        "refusing to load it" in line
    ), line
    assert out.returncode == 1 and not marker.exists()
    assert not (project / "hf" / "model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_export_alone_stays_weights_only_whatever_the_environment_says(zero_ckpt, tmp_path):
    """`python -m trainer.export` run by hand, with torch's opt-out variable set: still refused. And
    with the shard check skipped, DeepSpeed's own torch.load(weights_only=False) is weights-only."""
    marker = tmp_path / "pwned"
    poison_shard(copy_tag(zero_ckpt, tmp_path / "ckpt"), OPTIM_STATES, RunsACommand(marker))
    out = export(tmp_path / "ckpt", tmp_path / "hf", env={"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"})
    line = one_error(out, "export: error: ")
    assert f"{OPTIM_STATES} holds a pickled object outside the allowlist (GLOBAL posix.system)" in line
    assert out.returncode == 3 and not marker.exists() and not (tmp_path / "hf").exists()

    unchecked = (
        "import sys, pickle; from trainer.safe_load import guard_torch_load; guard_torch_load()\n"
        "from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as merge\n"
        "try: merge(sys.argv[1], tag=sys.argv[2])\n"
        "except pickle.UnpicklingError as exc: print('refused:', 'GLOBAL posix.system' in str(exc))\n"
    )
    argv = [sys.executable, "-c", unchecked, str(tmp_path / "ckpt"), TAG]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO, env=h.rank_env())
    assert "refused: True" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_good_zero_checkpoint_still_exports_through_ckpt_pull(zero_ckpt, project, gpuctl, tmp_path):
    import torch

    from trainer.safe_load import DEEPSPEED_GLOBALS

    for name in (MODEL_STATES, OPTIM_STATES):  # the allowlist is what DeepSpeed's real files need
        unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(zero_ckpt / TAG / name))
        assert unsafe <= {f"{module}.{name}" for module, name in DEEPSPEED_GLOBALS}
    out = pull_hf(project, gpuctl, zero_ckpt / TAG)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (project / "hf" / "model.safetensors").is_file() and (project / "hf" / "tokenizer.json").is_file()


# -- FSDP: DCP's .metadata is a plain pickle.load in torch's FileSystemReader ------------------------
def hostile_metadata(tag_dir: Path, how: str, marker: Path) -> str:
    """Rewrite tag_dir/.metadata; the refusal the export must print."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    path = tag_dir / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # our own run's file
    if how == "whole file":
        path.write_bytes(pickle.dumps(RunsACommand(marker)))
        return ".metadata holds a pickled object outside the allowlist (GLOBAL posix.system)"
    if how == "inside the record":
        metadata.storage_meta.modules = [WritesAFile(marker)]
        path.write_bytes(pickle.dumps(metadata))
        return ".metadata holds a pickled object outside the allowlist (GLOBAL pathlib.Path.write_text)"
    key = "model.model.embed_tokens.weight"
    if how == "bytes entry":  # DCP torch.loads a bytes entry with weights_only=False
        import torch

        blob = io.BytesIO()
        torch.save(RunsACommand(marker), blob)
        (tag_dir / "__9_0.distcp").write_bytes(blob.getvalue())
        metadata.state_dict_metadata[key] = BytesStorageMetadata()
        metadata.storage_data = {i: info for i, info in metadata.storage_data.items() if i.fqn != key}
        metadata.storage_data[MetadataIndex(key)] = _StorageInfo("__9_0.distcp", 0, len(blob.getvalue()))
        path.write_bytes(pickle.dumps(metadata))
        return f".metadata lists {key} as BytesStorageMetadata, not a tensor"
    outside = tag_dir.parent / "outside.bin"  # how == "path outside": the reader opens what it names
    outside.write_bytes(b"\0" * 100_000)
    index = next(i for i in metadata.storage_data if i.fqn == key)
    metadata.storage_data[index] = _StorageInfo("../outside.bin", 0, metadata.storage_data[index].length)
    path.write_bytes(pickle.dumps(metadata))
    return ".metadata points at '../outside.bin', not a file of the tag"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("how", ["whole file", "inside the record", "bytes entry", "path outside"])
def test_export_never_unpickles_a_hostile_dcp_metadata(dcp_ckpt, tmp_path, how):
    marker = tmp_path / "pwned"
    tag_dir = copy_tag(dcp_ckpt, tmp_path / "ckpt")
    expected = hostile_metadata(tag_dir, how, marker)
    out = export(tmp_path / "ckpt", tmp_path / "hf")
    line = one_error(out, "export: error: ")
    assert line.startswith(f"export: error: checkpoint {TAG}: ") and expected in line, line
    assert out.returncode == 3 and not marker.exists() and not (tmp_path / "hf").exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_good_fsdp_checkpoint_still_exports(dcp_ckpt, tmp_path):
    out = export(dcp_ckpt, tmp_path / "hf")
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "hf" / "model.safetensors").is_file()

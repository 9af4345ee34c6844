"""Checkpoints: save (every rank), upload (local rank 0 of each node), prune, and resume.

A checkpoint is DeepSpeed's save dir checkpoints/step<N>/ (per-rank ZeRO shards) plus
trainer_state.json, written next to the shards by each node's local rank 0:
{"step", "samples_seen", "data_seed", "world_size", "train_batch_size", "model", "tokenizer",
"seq_len"}. The same values go into DeepSpeed's client_state; the side file lets resume check
the world size before DeepSpeed loads anything, and trainer.export rebuild the model.
"""

from __future__ import annotations

import gc
import json
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from trainer import events
from trainer.config import DistEnv, RunConfig, TrainerError
from trainer.diskroom import LocalTag, Room, expected_save_bytes, free_bytes, plan_room, tag_bytes

CKPT_DIR = "checkpoints"
NOTHING_WAITING = 1 << 24  # coalesce's "no upload waits here" (above any step)
STATE_FILE = "trainer_state.json"
METRICS_FILE = "metrics.jsonl"  # a copy of the run's metrics.jsonl as of the checkpoint (rank 0's node)
_TAG_STEP = re.compile(r"^step(\d+)$")


@dataclass(frozen=True)
class Position:
    """Where training stands: optimizer steps done and samples consumed from the data order."""

    step: int = 0
    samples_seen: int = 0


def open_store(cfg: RunConfig, log: Callable[[str], None]):
    """The object store from run.json's storage block, or None when there is none."""
    if not cfg.storage or not cfg.storage.get("url"):
        return None
    # light: no torch; boto3 only for s3://
    from trainer.objstore.store import CheckpointStore

    try:
        return CheckpointStore.from_config(cfg.storage, log=log)
    except ValueError as exc:
        raise TrainerError(f"run.json storage: {exc}") from None


class Checkpointer:
    """Saves tags when the disk has room, hands them to the background uploader, keeps `keep_local`."""

    POLL_S = 10.0  # while waiting for an upload to free disk: how long one collective may wait

    def __init__(
        self,
        engine,
        cfg: RunConfig,
        env: DistEnv,
        store,
        log: Callable[[str], None],
        *,
        params: int = 0,
        precision: str = "fp32",
    ):
        self.engine, self.cfg, self.env, self.log = engine, cfg, env, log
        self.params, self.precision = params, precision
        self.dir = cfg.run_dir / CKPT_DIR
        self.uploader = None
        self.last_tag: str | None = None
        self.last_bytes: int | None = None  # this node's last save, measured by local rank 0 as it finished
        self.from_store: set[str] = set()  # the tag fetched for resume: the store has it
        if cfg.resume and not cfg.resume.startswith("/") and (self.dir / "latest").is_file():
            self.from_store.add((self.dir / "latest").read_text().strip())
        if store is not None and env.is_dir_main:
            from trainer.objstore.uploader import BackgroundUploader

            done = (lambda tag: events.checkpoint(tag, "published")) if env.is_main else None
            skip = (lambda tag: events.checkpoint(tag, "superseded")) if env.is_main else None
            nodes = 1 if env.shared_dir else cfg.num_nodes  # one shared run dir: rank 0 uploads every node's files
            self.uploader = BackgroundUploader(store, env.node_rank, nodes, on_done=done, on_skip=skip)
        self.has_store = store is not None  # the same on every rank: whether save() coalesces uploads
        if store is not None:  # this start's markers only: an earlier attempt's may still be in the store
            store.attempt = f"{_attempt_everywhere():016x}"

    def save(self, pos: Position, train_batch_size: int, final: bool = False) -> str | None:
        """Save tag step<N> on every rank (collective); None when the disk had no room (skipped)."""
        tag = f"step{pos.step}"
        self.coalesce(tag)
        if not self.make_room(tag, final):
            return None
        state = {
            "step": pos.step,
            "samples_seen": pos.samples_seen,
            "data_seed": self.cfg.train.seed,
            "world_size": self.env.world_size,
            "train_batch_size": train_batch_size,
            # what trainer.export rebuilds the model from
            "model": self.cfg.train.model,
            "tokenizer": self.cfg.train.tokenizer,
            "seq_len": self.cfg.train.seq_len,
        }
        events.checkpoint(tag, "saving")
        self.engine.save_checkpoint(str(self.dir), tag=tag, client_state=state)
        if self.env.is_dir_main:
            (self.dir / tag / STATE_FILE).write_text(json.dumps(state) + "\n")
        if self.env.is_main and (self.cfg.run_dir / METRICS_FILE).is_file():
            # the steps so far travel with the checkpoint: a run resumed from it on a new node
            # continues metrics.jsonl even when no laptop kept a copy (flows/recover.py)
            shutil.copyfile(self.cfg.run_dir / METRICS_FILE, self.dir / tag / METRICS_FILE)
        dist.barrier()  # every shard of this node is on disk before upload
        if self.uploader is not None:
            self.uploader.submit(self.dir / tag, tag, pos.step, self.env.world_size)
        if self.env.is_dir_main:
            self.log(f"checkpoint {tag} saved" + (", uploading" if self.uploader else ""))
            self.last_bytes = tag_bytes(self.dir / tag)
            events.checkpoint(tag, "uploading" if self.uploader else "saved", self.last_bytes)
            self.prune()
        self.last_tag = tag
        return tag

    def coalesce(self, tag: str) -> None:
        """Collective: uploads still waiting on every node when a new save begins are superseded by it (skipped;
        the uploader logs it, events.jsonl says "superseded"), so uploads slower than saves keep at most one
        running and one waiting. Only steps that wait on every node go: no node starts a tag another drops."""
        if not self.has_store:
            return
        up = self.uploader
        oldest = up.hold() if up is not None else None
        agreed = None
        try:
            # MAX over ranks: ranks without an uploader say -1; a node with nothing waiting says NOTHING_WAITING
            mine = -1 if up is None else (NOTHING_WAITING if oldest is None else oldest)
            agreed = _max_everywhere(mine)
        finally:
            if up is not None:
                drop = agreed if agreed is not None and 0 <= agreed < NOTHING_WAITING else None
                up.release(drop, by=f"checkpoint {tag}")

    def make_room(self, tag: str, final: bool) -> bool:
        """Collective: every run dir's main rank frees what is safe (trainer.diskroom) and all ranks agree.
        While an upload runs that would free space, everyone waits in short rounds of POLL_S."""
        need = self.expected_bytes()
        waited = False
        while True:
            mine = self._room(need) if self.env.is_dir_main else Room.ROOM
            verdict = Room(_max_everywhere(int(mine)))
            if verdict == Room.ROOM:
                return True
            if verdict == Room.NO_ROOM:
                message = (
                    f"no disk room for checkpoint {tag}: it needs {_size(need)} and the node has "
                    f"{_size(free_bytes(self.dir))} free with nothing left to delete or wait for"
                )
                if final:
                    raise TrainerError(message + "; raise provider.disk_gb (gpuctl plan sizes it)")
                self.log(f"warning: {message}; skipped (the next save tries again)")
                return False
            if not waited:
                self.log(f"checkpoint {tag} waits for an upload to free disk ({_size(need)} needed)")
                waited = True
            if mine == Room.WAIT and self.uploader is not None:
                self.uploader.wait_progress(self.POLL_S)

    def _room(self, need: int) -> Room:
        tags = [LocalTag(step, name, tag_bytes(self.dir / name)) for step, name in local_tags(self.dir)]
        uploaded = self.uploader.uploaded_tags() if self.uploader is not None else None
        pending = self.uploader.pending_tags() if self.uploader is not None else []
        # a superseded tag will never be uploaded; the save about to begin replaces it: safe like a stored one
        gone = self.from_store | set(self.uploader.superseded_tags() if self.uploader is not None else ())
        verdict, delete = plan_room(
            tags, uploaded, gone, pending, free_bytes(self.dir), need, self.cfg.train.keep_local
        )
        for t in delete:
            shutil.rmtree(self.dir / t.name, ignore_errors=True)
        return verdict

    def expected_bytes(self) -> int:
        """This node's share of one save: the last save's size when local rank 0 measured one, else the formula.
        (Measured once as the save finished: by the next save, the uploader may have deleted that tag.)"""
        if self.last_bytes:
            return self.last_bytes
        env = self.env
        if env.shared_dir:  # the one run dir holds every node's share: node 0's with every rank's shard
            return expected_save_bytes(self.params, self.precision, env.world_size, env.world_size, 0)
        return expected_save_bytes(self.params, self.precision, env.world_size, env.local_world_size, env.node_rank)

    def finish(self) -> None:
        """Final sync, outside any collective: wait for every upload of this node, then prune."""
        if self.uploader is not None:
            from trainer.objstore.backends import StorageError

            self.log("waiting for checkpoint uploads to finish")
            try:
                self.uploader.close()
            except StorageError as exc:
                raise TrainerError(f"checkpoint upload failed: {exc}", everywhere=False) from None
            self.prune()

    def prune(self) -> None:
        """Delete local tags beyond the newest keep_local once the store has them or a newer one
        (a tag whose upload failed goes once a later tag is up; a tag downloaded for resume, or superseded
        by a newer save, too)."""
        tags = sorted(local_tags(self.dir))
        uploaded = self.uploader.uploaded_tags() if self.uploader is not None else None
        superseded = set(self.uploader.superseded_tags()) if self.uploader is not None else set()
        newest_up = max((step for step, tag in tags if uploaded and tag in uploaded), default=-1)
        for step, tag in tags[: -self.cfg.train.keep_local]:
            if uploaded is None or tag in uploaded or step < newest_up or tag in self.from_store | superseded:
                shutil.rmtree(self.dir / tag, ignore_errors=True)


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def local_tags(ckpt_dir: Path) -> list[tuple[int, str]]:
    if not ckpt_dir.is_dir():
        return []
    return [(int(m.group(1)), p.name) for p in ckpt_dir.iterdir() if p.is_dir() and (m := _TAG_STEP.match(p.name))]


def resume(engine, cfg: RunConfig, env: DistEnv, store, log: Callable[[str], None]) -> Position:
    """Load the checkpoint run.json asks for; returns where to continue (step 0 when fresh)."""
    if cfg.resume is None:
        return Position()
    events.phase("resuming", f"checkpoint {cfg.resume}" + ("" if cfg.resume.startswith("/") else " from the store"))
    if cfg.resume.startswith("/"):
        load_dir, tag = locate_local(Path(cfg.resume))
    else:
        load_dir, tag = fetch_from_store(cfg, env, store, log)
    check_compatible(load_dir / tag, env)
    with mapped_loads():
        load_path, client_state = engine.load_checkpoint(str(load_dir), tag=tag)
    if load_path is None or not client_state:
        raise TrainerError(f"DeepSpeed could not load checkpoint {load_dir / tag}")
    if cfg.train.strategy == "deepspeed":  # FSDP's DCP load copies into the live shards: nothing stays mapped
        copied = own_optimizer_state(engine)
        still = mapped_files(load_dir / tag)
        log(
            f"resume: checkpoint files memory-mapped; {copied / 1e9:.3f} GB of optimizer state copied off them"
            f" on rank 0, {len(still)} file(s) still mapped"
        )
    if client_state.get("data_seed") != cfg.train.seed:
        log(
            f"warning: checkpoint data_seed {client_state.get('data_seed')} != train.seed "
            f"{cfg.train.seed}; the data order will not continue exactly"
        )
    log(f"resumed from {load_dir / tag} at step {client_state['step']}")
    return Position(step=int(client_state["step"]), samples_seen=int(client_state["samples_seen"]))


@contextmanager
def mapped_loads() -> Iterator[None]:
    """torch.load memory-maps files while DeepSpeed loads a checkpoint (torch's serialization config):
    each rank's 12 B/param optimizer shard and the 16-bit module states become page cache, not a second
    copy in RAM on every rank at once."""
    from torch.utils.serialization import config

    before = config.load.mmap
    config.load.mmap = True
    try:
        yield
    finally:
        config.load.mmap = before


def own_optimizer_state(engine) -> int:
    """After a mapped load, give the optimizer state its own memory; returns the bytes copied.

    torch's Optimizer.load_state_dict keeps loaded tensors of the right dtype and device as they are, so
    Adam's m and v would stay views of the mapped shard: its pages count as the process's, and a pruned
    checkpoint's disk blocks would stay allocated while mapped. Copies are made one tensor at a time
    (one 4 B/param buffer of headroom), then DeepSpeed re-links its per-parameter views of the state."""
    import torch

    zero = engine.optimizer
    base = getattr(zero, "optimizer", zero)
    copied = 0
    for state in getattr(base, "state", {}).values():
        for key, value in list(state.items()):
            if torch.is_tensor(value) and value.numel() > 1:
                state[key] = value.clone()
                copied += value.nbytes
                del value
    relink = getattr(zero, "_link_all_hp_params", None)  # DeepSpeed ZeRO-1/2 (0.19): views into the state
    if copied and callable(relink):
        relink()
    gc.collect()
    return copied


def mapped_files(under: Path) -> list[str]:
    """Files under `under` this process still has memory-mapped (Linux /proc/self/maps)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    prefix = str(under.resolve())
    return sorted({line.split(None, 5)[5].strip() for line in maps.splitlines() if prefix in line})


def locate_local(path: Path) -> tuple[Path, str]:
    """A save dir holding `latest` (its tag), or a tag dir itself."""
    if (path / "latest").is_file():
        return path, (path / "latest").read_text().strip()
    if path.is_dir() and (any(path.glob("*model_states.pt")) or (path / ".metadata").is_file()):  # DS or FSDP (DCP)
        return path.parent, path.name
    raise TrainerError(
        f"resume {path}: not a DeepSpeed save dir (no 'latest' file) nor a checkpoint tag dir (DeepSpeed or FSDP)"
    )


def fetch_from_store(cfg: RunConfig, env: DistEnv, store, log) -> tuple[Path, str]:
    """Each run dir's main rank (DistEnv.is_dir_main) downloads the tag into checkpoints/; the others wait."""
    if store is None:
        raise TrainerError(f"resume {cfg.resume!r} needs object storage, but run.json has none")
    from trainer.objstore.backends import StorageError

    dest = cfg.run_dir / CKPT_DIR
    error = None
    if env.is_dir_main:
        try:
            wanted = store.latest() if cfg.resume == "latest" else store.info(cfg.resume)
            if wanted is not None and wanted.world_size != env.world_size:  # before fetching gigabytes
                error = world_size_message(wanted.tag, wanted.world_size, env.world_size)
            else:
                info = store.download(None if cfg.resume == "latest" else cfg.resume, dest)
                log(f"downloaded checkpoint {info.tag} (step {info.step}) from {store.url}")
        except (StorageError, ValueError) as exc:  # ValueError: not a valid tag name
            error = f"cannot fetch checkpoint {cfg.resume!r}: {exc}"
    failed = _any_failed(error is not None)
    if failed:
        raise TrainerError(error or "checkpoint download failed on another node", everywhere=error is None)
    return dest, (dest / "latest").read_text().strip()


def _any_failed(flag: bool) -> bool:
    """All ranks learn whether any rank failed (also serves as the barrier)."""
    return _max_everywhere(1 if flag else 0) > 0


def _max_everywhere(value: int) -> int:
    """The largest value any rank passed (a collective: every rank calls it)."""
    import torch
    from deepspeed.accelerator import get_accelerator

    device = "cpu" if dist.get_backend() == "gloo" else get_accelerator().current_device_name()
    t = torch.tensor([value], dtype=torch.int64, device=device)  # exact for any int64, unlike float32
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _attempt_everywhere() -> int:
    """One random 62-bit id for this start of the run, the same on every rank (rank 0 draws it)."""
    import secrets

    return _max_everywhere(secrets.randbits(62) if dist.get_rank() == 0 else 0)


def check_compatible(tag_dir: Path, env: DistEnv) -> None:
    state_file = tag_dir / STATE_FILE
    if not tag_dir.is_dir():
        raise TrainerError(f"checkpoint {tag_dir} does not exist")
    if state_file.is_file():
        saved = json.loads(state_file.read_text())["world_size"]
    else:  # a save dir not written by this trainer: count the ZeRO optimizer shards
        saved = len(list(tag_dir.glob("*zero_pp_rank_*optim_states.pt"))) or env.world_size
    if saved != env.world_size:
        raise TrainerError(world_size_message(tag_dir.name, saved, env.world_size))


def world_size_message(tag: str, saved: int, world: int) -> str:
    return (
        f"checkpoint {tag} was saved by {saved} ranks but this run has {world}; resume needs the "
        "same world size (or export the weights with zero_to_fp32 and start a new run from them)"
    )

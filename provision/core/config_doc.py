"""What each gpuctl.yaml key means, read from the pydantic models' Field(description=...): the one source
for the comments of the gpuctl.yaml `init` writes (templates/gpuctl.yaml.j2 calls `doc`) and for the config
reference page (provision/cli/docs_gen.py). A key's meaning is written once, in its model."""

from __future__ import annotations

import textwrap
import types
import typing
from typing import Any, Literal, Union

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from provision.core.config import DockerConfig, GpuctlConfig, StorageConfig, TrainConfig
from provision.core.provider_config import (
    AWSProvider,
    LocalProvider,
    RunPodProvider,
    SlurmProvider,
    SSHProvider,
    VastProvider,
)
from provision.core.recovery import RecoveryConfig

PROVIDERS: dict[str, type[BaseModel]] = {
    "local": LocalProvider,
    "ssh": SSHProvider,
    "vast": VastProvider,
    "runpod": RunPodProvider,
    "aws": AWSProvider,
    "slurm": SlurmProvider,
}
SECTIONS: dict[str, type[BaseModel]] = {
    "train": TrainConfig,
    "storage": StorageConfig,
    "docker": DockerConfig,
    "recovery": RecoveryConfig,
}
TOP_LEVEL = ("name", "teardown", "env", "secrets")  # scalar keys of the file's top level


def field_of(kind: str, key: str) -> FieldInfo:
    """The model field behind a dotted key (`train.seq_len`, `provider.gpu`, `teardown`) for this provider kind."""
    section, _, name = key.rpartition(".")
    model: type[BaseModel] = GpuctlConfig
    if section == "provider":
        model = PROVIDERS[kind]
    elif section:
        model = SECTIONS[section]
    return model.model_fields[name]


def doc(kind: str, key: str, width: int = 110) -> str:
    """The key's description as YAML comment lines, indented as the key is (no trailing newline)."""
    indent = "  " * key.count(".")
    text = field_of(kind, key).description or ""
    lines = textwrap.wrap(text, width=width - len(indent) - 2, break_on_hyphens=False)
    return "\n".join(f"{indent}# {line}" for line in lines)


def type_text(field: FieldInfo) -> str:
    """The annotation as a reader says it: `int or null`, `list of string`."""
    return _type_words(field.annotation)


def _type_words(ann: Any) -> str:
    origin = typing.get_origin(ann)
    if origin is Literal:
        return "one of " + ", ".join(f"`{v}`" for v in typing.get_args(ann))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_words(a) for a in typing.get_args(ann))
    if origin is list:
        return f"list of {_type_words(typing.get_args(ann)[0])}"
    if origin is dict:
        return "mapping of string to string"
    names = {str: "string", int: "integer", float: "number", bool: "true/false", type(None): "null"}
    return names.get(ann, getattr(ann, "__name__", str(ann)))


def default_value(field: FieldInfo) -> Any:
    """The field's default, a default factory's value included; PydanticUndefined when required."""
    if field.default_factory is not None:
        return field.default_factory()  # type: ignore[call-arg]
    return field.default


def default_text(field: FieldInfo) -> str:
    value = default_value(field)
    if value is PydanticUndefined:
        return "required"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return (
        f"`{value}`" if not isinstance(value, (list, dict)) or value else "`[]`" if isinstance(value, list) else "`{}`"
    )


def bounds_text(field: FieldInfo) -> str:
    """The value bounds pydantic enforces: `>= 1, <= 64`, a pattern, a length."""
    words = []
    for meta in field.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(meta, attr, None) is not None:
                words.append(f"{sign} {getattr(meta, attr)}")
        if getattr(meta, "pattern", None):
            words.append(f"matches `{meta.pattern}`")
        if getattr(meta, "max_length", None) is not None:
            words.append(f"at most {meta.max_length} items")
        if getattr(meta, "min_length", None) is not None:
            words.append(f"at least {meta.min_length} item(s)")
    return ", ".join(words)

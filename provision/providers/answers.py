"""Reading a vendor's answer: the fields gpuctl uses, checked for their types, or one line.

A vendor API answers with JSON whose shape gpuctl expects from the vendor's docs and client. An
answer that has another shape (offers as a list, no `dph_total`, a port that is no number, a dict
where an id belongs) is a ProviderError naming the vendor, what was asked and the field, never a
traceback; providers/cloud.py's abort then terminates whatever the attempt created (found by
its label when the answer did not give a usable id).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationError,
)

from provision.core.errors import ProviderError
from provision.core.terminal import scrub
from provision.providers.instance import Instance

M = TypeVar("M", bound=BaseModel)
FIX = "retry; if it persists, the vendor's API answers in a new way (GPUCTL_DEBUG=1 shows where gpuctl stopped)"


def _no_bool(value: object) -> object:
    if isinstance(value, bool):
        raise ValueError("a boolean is no number here")
    return value


Id = StrictInt | Annotated[StrictStr, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")]
Port = Annotated[int, BeforeValidator(_no_bool), Field(ge=1, le=65535)]
Number = Annotated[float, BeforeValidator(_no_bool)]
Count = Annotated[int, BeforeValidator(_no_bool), Field(ge=0, le=1024)]
Text = Annotated[str, AfterValidator(lambda s: s[:4096])]


class Answer(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


def read(model: type[M], raw: object, vendor: str, what: str) -> M:
    """`raw` as `model`, or the ProviderError that names the first field that does not fit."""
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(the answer)"
        raise ProviderError(
            scrub(f"{vendor} answered {what} in a shape gpuctl cannot read: {where}: {first['msg']}")[:400], FIX
        ) from None


def obj(raw: object, vendor: str, what: str) -> dict[str, Any]:
    """A JSON object answer (None, as for an empty body: {}); anything else is a ProviderError."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ProviderError(f"{vendor} answered {what} with a JSON {type(raw).__name__}, not an object", FIX)
    return raw


def items(raw: object, vendor: str, what: str) -> list[Any]:
    """A JSON list in an answer (None: empty); anything else is a ProviderError."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ProviderError(f"{vendor} answered {what} with a JSON {type(raw).__name__} where a list belongs", FIX)
    return raw


class Listed(Answer):
    """What is left to know of a listed instance whose other fields do not read."""

    id: Id
    label: Text | None = None  # Vast
    name: Text | None = None  # RunPod


def listed(raw: object, parse: Callable[[object], Instance]) -> Instance | None:
    """One entry of an account's list of instances: in full, or, when its shape does not read,
    by its id and label alone (an instance gpuctl did not make, in a shape of its own, must not
    stop `down`; one it made must still be waited for); None when it has not even an id."""
    try:
        return parse(raw)
    except ProviderError:
        try:
            bare = Listed.model_validate(raw)
        except ValidationError:
            return None
        return Instance(id=str(bare.id), state="(unreadable)", label=bare.label or bare.name or "")


# --- Vast.ai --------------------------------------------------------------------------------------


class VastOffer(Answer):
    id: Id
    gpu_name: Text = "?"
    num_gpus: Count | None = None
    dph_total: Number
    min_bid: Number | None = None
    cpu_ram: Number | None = None
    disk_space: Number | None = None
    geolocation: Text | None = None
    reliability: Number | None = None
    reliability2: Number | None = None
    machine_id: Id | None = None
    inet_down: Number | None = None  # Mbit/s, Vast's measurement of the host


class VastInstance(Answer):
    id: Id
    actual_status: Text | None = None
    intended_status: Text | None = None
    cur_state: Text | None = None
    status_msg: Text | None = None
    label: Text | None = None
    public_ipaddr: Text | None = None
    ssh_host: Text | None = None
    ssh_port: Port | None = None
    ports: dict[str, Any] | None = None
    dph_total: Number | None = None  # what the instance is billed ($/h)


class VastPort(Answer):
    HostPort: Port


class VastContract(Answer):
    new_contract: Id


# --- RunPod ---------------------------------------------------------------------------------------


class RunPodPort(Answer):
    ip: Text | None = None
    isIpPublic: bool | None = None
    privatePort: Port | None = None
    publicPort: Port | None = None
    type: Text | None = None


class RunPodRuntime(Answer):
    ports: list[RunPodPort] | None = None


class RunPodPod(Answer):
    id: Id
    name: Text | None = None
    desiredStatus: Text | None = None
    costPerHr: Number | None = None
    machineId: Id | None = None
    runtime: RunPodRuntime | None = None


class RunPodPrice(Answer):
    minimumBidPrice: Number | None = None
    uninterruptablePrice: Number | None = None
    stockStatus: Text | None = None


class RunPodGpu(Answer):
    id: Text
    displayName: Text | None = None
    secure: RunPodPrice | None = None
    community: RunPodPrice | None = None

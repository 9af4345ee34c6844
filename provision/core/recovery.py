"""gpuctl.yaml's `recovery:` section: what happens when a node is lost mid-run (preempted, its
host gone). The follow loop (provision/flows/recover.py) reads it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_RESTARTS_INTERRUPTIBLE = 3  # spot/bid offers are taken back as a matter of course


class RecoveryConfig(BaseModel):
    """recovery: max_restarts, lost_after, exclude_lost_hosts."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    max_restarts: int | None = Field(
        default=None,
        ge=0,
        le=100,
        description="new nodes a run may get; null = 3 for interruptible offers, 0 otherwise (then a lost run is marked lost, its nodes terminated, and gpuctl prints the command that resumes it). Provider slurm: how often Slurm may requeue the job (--requeue), each restart resuming from the newest complete checkpoint",
    )
    lost_after: float = Field(
        default=300,
        ge=10,
        le=86_400,
        description="seconds a node may stay unreachable while its vendor still says running before it is lost",
    )
    exclude_lost_hosts: bool = Field(
        default=True,
        description="never rent a lost node's host again for this run (vast: the offer's machine_id; runpod, which picks the machine itself: a new pod on a lost machineId is terminated and asked for again)",
    )

    def restarts_allowed(self, interruptible: bool) -> int:
        if self.max_restarts is not None:
            return self.max_restarts
        return DEFAULT_RESTARTS_INTERRUPTIBLE if interruptible else 0

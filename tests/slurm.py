"""A real one-machine Slurm cluster on loopback (Debian's slurm-wlm 22.05: slurmctld + slurmd).

``SlurmCluster`` writes its own slurm.conf (own ports, state and spool folders under a temp dir,
proctrack/linuxproc, task/none, select/cons_tres, no accounting storage) and starts slurmctld and
two slurmd, nodes n0 and n1 (NodeAddr=127.0.0.1, a Port= each, `slurmd -N NAME`; spool, pid and log
per node through slurm.conf's %n), as this user (root here) in the foreground: a job on two nodes
runs a task on each, as on two machines sharing one filesystem.
Authentication is auth/none with cred/none: Slurm 22.05 still ships them, so no munged (and no
key) is needed for a cluster that only loopback reaches. Client commands (sinfo, sbatch, squeue,
scancel, scontrol) find it through ``SLURM_CONF``, which ``env`` holds.

Fixture (registered by tests/conftest.py's ``pytest_plugins``): ``slurm``, one cluster per test
session, skipped with the reason when slurm-wlm is not installed. Tests that ask for it get
SLURM_CONF in their environment (and in gpuctl's) and a partition with no job left over.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import free_port

CPUS = 4  # more than this machine's cores may be: SlurmdParameters=config_overrides lets slurmd take it
# GPUs Slurm believes the node has (gres.conf: a count, no device files): enough for `up`'s GPU checks and
# sbatch --test-only; no test runs a job that asks for them (the ranks are CPU ranks).
GPUS = 2
NODES = ("n0", "n1")
GRES = "NodeName=n[0-1] Name=gpu File=/dev/tty[1-{gpus}]\n"
CONF = """ClusterName=gpuctltest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SrunPortRange={srun_lo}-{srun_hi}
AuthType=auth/none
CredType=cred/none
SlurmUser={user}
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
GresTypes=gpu
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
KillWait=5
MinJobAge=600
NodeName=n0 NodeAddr=127.0.0.1 Port={n0_port} CPUs={cpus} RealMemory=4000 Gres=gpu:{gpus} State=UNKNOWN
NodeName=n1 NodeAddr=127.0.0.1 Port={n1_port} CPUs={cpus} RealMemory=4000 Gres=gpu:{gpus} State=UNKNOWN
PartitionName=debug Nodes=n0,n1 Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: list[subprocess.Popen] = []

    def start(self, deadline_s: float = 60) -> None:
        for sub in ("state", *(f"spool-{node}" for node in NODES)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        lo = free_port()
        self.conf.write_text(
            CONF.format(
                ctld_port=free_port(),
                n0_port=free_port(),
                n1_port=free_port(),
                srun_lo=lo,
                srun_hi=lo + 20,
                user=os.environ.get("USER", "root"),
                root=self.root,
                cpus=CPUS,
                gpus=GPUS,
            )
        )
        (self.root / "gres.conf").write_text(GRES.format(gpus=GPUS))  # slurmd reads it beside slurm.conf
        for argv in (["slurmctld", "-D", "-i"], *(["slurmd", "-D", "-N", node] for node in NODES)):
            with open(
                self.root / f"{argv[0]}{''.join(argv[3:])}.out", "wb"
            ) as log:  # the daemon keeps its own copy of the fd
                self.procs.append(
                    subprocess.Popen([*argv, "-f", str(self.conf)], env=self.env, stdout=log, stderr=subprocess.STDOUT)
                )
        self.wait_idle(deadline_s)

    def sh(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=60, check=check)

    def wait_idle(self, deadline_s: float) -> None:
        """Until sinfo shows every node idle (the daemons answer and the nodes registered)."""
        deadline = time.monotonic() + deadline_s
        seen = ""
        while time.monotonic() < deadline:
            seen = self.sh("sinfo", "--noheader", "--format", "%T", check=False).stdout.strip()
            if seen == "idle":
                return
            time.sleep(0.5)
        logs = "".join(
            log.read_text()[-2000:] for log in sorted(self.root.glob("*.out")) + [self.root / "slurmctld.log"]
        )
        raise RuntimeError(f"slurm did not come up within {deadline_s}s (sinfo: {seen!r}):\n{logs}")

    def jobs(self) -> list[str]:
        """`squeue`'s unfinished jobs: 'id state reason' lines."""
        out = self.sh("squeue", "--noheader", "--format", "%i %T %r").stdout
        return [line.strip() for line in out.splitlines() if line.strip()]

    def cancel_all(self) -> None:
        self.sh("scancel", "--user", os.environ.get("USER", "root"), check=False)

    def stop(self, deadline_s: float = 30) -> None:
        """Cancel every job and wait until Slurm lists none (slurmd ends the steps it started: stopped
        first, it would leave their slurmstepd and ranks running), then stop the daemons."""
        self.cancel_all()
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline and self.sh("squeue", "--noheader", check=False).stdout.strip():
            time.sleep(0.5)
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    if not (shutil.which("slurmctld") and shutil.which("slurmd") and shutil.which("sbatch")):
        pytest.skip("slurm-wlm is not installed (apt-get install slurm-wlm)")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def slurm(slurm_cluster, monkeypatch):
    """The session's Slurm, with SLURM_CONF set for this test (and the gpuctl it runs); no job
    is left from an earlier test."""
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))
    slurm_cluster.cancel_all()
    yield slurm_cluster
    slurm_cluster.cancel_all()

"""Provider `slurm`: a cluster your lab or company runs. Slurm is the engine: gpuctl submits, follows
and cancels one batch job per run through the login node, and never schedules itself.

`up` only checks the login node (Slurm answers, the partition has nodes, `sbatch --test-only`
accepts the job's account/QOS/shape, the workdir exists and is writable) and records the cluster;
no allocation is held while idle. `train` ships the bundle to the shared workdir like any node and
`SlurmNode.start_detached` submits it: the batch script (slurm.sh) runs launch.sh on the job's first
node, whose launcher is one `srun` step with a task per node (each starts its node's ranks). The job id
stands where other providers keep launch.sh's process group: alive = Slurm still lists the job
unfinished, stopping it = `scancel`. Secrets go through the run's 0600
secrets.env on the shared filesystem, which the ranks read themselves; never `--export` values.
"""

from __future__ import annotations

import math
import re
import shlex
import time
from collections.abc import Callable
from pathlib import Path

from provision.core import state
from provision.core.config import GpuctlConfig
from provision.core.errors import ConfigError, RemoteError
from provision.core.provider_config import SlurmProvider
from provision.providers.base import ProviderBackend, SelfTeardown, UpOptions
from provision.transport.remote import CommandResult, LineSink, LocalNode, Node

BATCH_SCRIPT = "slurm.sh"
# Unfinished states of `scontrol show job` (the rest are terminal: COMPLETED, FAILED, CANCELLED, TIMEOUT, ...).
ALIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD", "RESIZING"}
# sbatch copies the whole submitting environment into the job by default, and slurmctld stores it in
# its state files: only these names travel (their values, never a secret), plus Slurm's own SLURM_*.
EXPORT = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TZ", "TMPDIR")
# A state or reason reaches the terminal: Slurm's own words only (letters, digits, a little punctuation).
JOB_FIELD = re.compile(r"\b(JobState|Reason)=([A-Za-z0-9_.:,()+-]{1,100})(?=\s|$)")
# The doctor's short job: how long srun may wait for a node before the checks fail with its word.
DOCTOR_QUEUE_S = 60
JOB_ID = re.compile(r"^(\d{1,12})(;\S+)?$")
# sacct's State: a word, then perhaps "by <uid>" (CANCELLED by 0).
ACCT_STATE = re.compile(r"^([A-Z_]{1,40})\b")
SELECT_TYPE = re.compile(r"^SelectType\s*=\s*(\S+)", re.M)
# One GPU entry of sinfo's %G: gpu:4, gpu:a100:4 (the socket part "(S:0-1)" is cut off first).
GPU_GRES = re.compile(r"(?:^|,)gpu(?::[^:,]+)?:(\d+)")
# The batch script runs on the job's first node. launch.sh runs there once (status.json, job.log, secrets,
# setup and after-run commands as on any node); its launcher is one srun step with one task per node, each
# starting that node's ranks (trainer/slurm_node.py). The rank layout comes from Slurm: the hostfile from
# its node list, MASTER_ADDR the first node's address (NodeAddr: how Slurm itself reaches it).
BATCH = r"""#!/bin/bash -l
# gpuctl run {run_id}: the Slurm batch script (provision/providers/slurm.py). Slurm schedules it;
# launch.sh does the rest as on any node. No secret is in here or on sbatch's command line.
# A login shell (-l): the site's profile defines `module` and the like for provider.setup, as sbatch's
# copy of the submitting environment would have (gpuctl passes only a few names, see EXPORT).
set -u
cd {run_dir} || exit 97
HOSTS=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
FIRST=${{HOSTS%%[[:space:]]*}}
MASTER_ADDR=$(scontrol show node --oneliner "$FIRST" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')
export MASTER_ADDR=${{MASTER_ADDR:-$FIRST}}
export GPUCTL_SLURM_HOSTS=$(echo $HOSTS)
printf '%s slots={slots}\n' $HOSTS > hostfile
echo "gpuctl: Slurm job $SLURM_JOB_ID on $SLURM_JOB_NODELIST (master $MASTER_ADDR)"
# Slurm 22.05's srun no longer reads SLURM_CPUS_PER_TASK: the step's tasks get the job's CPUs through this
[ -n "${{SLURM_CPUS_PER_TASK:-}}" ] && export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK
# The walltime warning (sbatch --signal=USR1@N) reaches every process of the job's steps: the ranks catch it,
# save a checkpoint and stop (trainer/stop_signal.py); the launchers ignore it, and so does launch.sh here.
export GPUCTL_STOP_SIGNAL=USR1
trap '' USR1
{requeue}bash launch.sh
RC=$?
{ended}exit $RC
"""
# With --requeue (recovery.max_restarts > 0) Slurm runs this script again after a preemption or a node
# failure, in the same run dir. The ranks delete secrets.env once they have read it, so the first start
# keeps a hard link (secrets.keep: the same 0600 file) for the next; it goes when the run ends for good.
REQUEUE = """RESTART=${{SLURM_RESTART_COUNT:-0}}
if [ "$RESTART" -gt {max_restarts} ]; then
  echo "gpuctl: Slurm requeued the job $RESTART times, more than recovery.max_restarts ({max_restarts}); not restarting"
  rm -f secrets.keep secrets.env
  printf '{{"state": "failed", "exit_code": 1, "started_at": %s, "ended_at": %s}}\n' "$(date +%s)" "$(date +%s)" > status.json
  exit 1
elif [ "$RESTART" -gt 0 ]; then
  echo "gpuctl: Slurm requeued the job (restart $RESTART of {max_restarts}): the ranks resume from the newest complete checkpoint"
  [ -f secrets.keep ] && ln -f secrets.keep secrets.env
  export GPUCTL_REQUEUED=$RESTART
elif [ -f secrets.env ]; then
  ln -f secrets.env secrets.keep
fi
"""
# After launch.sh: it wrote how the run ended. Succeeded or failed by itself: no requeue follows, so the
# kept secrets go. Cancelled (a signal: scancel, or Slurm's own requeue) keeps them for a restart;
# gpuctl removes them once Slurm lists the job as over (SlurmNode.drop_run_secrets).
ENDED = """grep -qE '"state": "(succeeded|failed)"' status.json 2>/dev/null && rm -f secrets.keep
"""


def job_options(prov: SlurmProvider) -> list[str]:
    """sbatch's options for one job of this provider: the shape, never a secret."""
    opts = ["--nodes", str(prov.nodes), "--ntasks-per-node", "1", "--time", prov.time]
    opts.append(f"--signal=USR1@{prov.save_before_walltime_s}")  # the ranks save and stop on it
    pairs = [
        ("--partition", prov.partition),
        ("--account", prov.account),
        ("--qos", prov.qos),
        ("--cpus-per-task", str(prov.cpus_per_task) if prov.cpus_per_task else None),
        ("--mem", prov.mem),
        ("--constraint", prov.constraint),
    ]
    opts += [part for flag, value in pairs if value for part in (flag, value)]
    if prov.gpus_per_node:  # `up` replaced auto with the site's way (gpu_request)
        gres = prov.gpu_request == "gres"
        opts += ["--gres", f"gpu:{prov.gpus_per_node}"] if gres else ["--gpus-per-node", str(prov.gpus_per_node)]
    return opts


def doctor_options(prov: SlurmProvider, timeout_s: float) -> list[str]:
    """The doctor's job: one node of the run's shape, for the checks' own time (short jobs start sooner)."""
    shape = prov.model_copy(update={"nodes": 1, "time": str(max(1, math.ceil(timeout_s / 60)))})  # minutes
    return [opt for opt in job_options(shape) if not opt.startswith("--signal")]


def site_gpu_request(config_text: str) -> str:
    """How this site's jobs ask for GPUs, from `scontrol show config`: --gpus-per-node needs
    select/cons_tres (Slurm 19.05+); a cons_res or linear site only knows --gres=gpu:N."""
    match = SELECT_TYPE.search(config_text)
    return "gpus-per-node" if match and match.group(1) == "select/cons_tres" else "gres"


def gres_gpus(gres: str) -> int:
    """GPUs of one node in sinfo's %G: 'gpu:4', 'gpu:a100:4(S:0-1)', 'gpu:a:2,gpu:b:2' (4), '(null)' (0)."""
    return sum(int(n) for n in GPU_GRES.findall(re.sub(r"\([^)]*\)", "", gres)))


def login_record(prov: SlurmProvider) -> state.NodeRecord:
    """The login node as the cluster records it: `local`, or where SSH reaches it (an ssh_config
    alias resolved as provider.hosts is, ProxyJump included)."""
    node = state.NodeRecord(
        host=prov.login,
        slots=prov.ranks_per_node,
        accelerator="cuda" if prov.gpus_per_node else "cpu",
        workdir=prov.workdir,
    )
    if prov.login != "local":
        from provision.transport.ssh import aliases

        config, shown = aliases.load(prov.ssh_config)
        found = aliases.resolve(prov.login, config, f"provider.login {prov.login!r}", shown)
        node.address, node.port, node.user, node.ssh = found.address, found.port, found.user, found.route
    return node


def identity(prov: SlurmProvider, base: Path | None) -> str | None:
    if not prov.identity_file:
        return None
    path = Path(prov.identity_file).expanduser()
    return str(path if path.is_absolute() else ((base or Path.cwd()) / path).resolve())


def login_node(rec: state.NodeRecord, identity_file: str | None, *, pin_new: bool = False) -> Node:
    """The node Slurm's commands run on: this machine, or the login host over SSH."""
    if rec.host == "local":
        return LocalNode()
    from provision.transport.ssh.node import SSHNode

    return SSHNode.from_record(rec, identity_file, pin_new=pin_new)


class SlurmNode(Node):
    """The login node, with the run's process group standing for its Slurm job."""

    def __init__(self, login: Node, options: list[str], prov: SlurmProvider | None = None):
        self.login, self.options, self.label = login, options, f"slurm ({login.label})"
        self.prov = prov

    def _execute(
        self, argv: list[str], timeout: float | None, stream: LineSink | None, stdin: bytes | None
    ) -> CommandResult:
        return self.login.run(argv, check=False, timeout=timeout, stream=stream, stdin=stdin)

    def put_dir(self, local: Path, remote: str) -> None:
        self.login.put_dir(local, remote)

    def close(self) -> None:
        self.login.close()

    def start_detached(self, cwd: str, script: str, log: str, restarts: int = 0) -> int:
        """Submit `script` as one batch job (through slurm.sh) with its output in `log`; the job id.
        restarts > 0: Slurm may requeue it that often (preemption, node failure), each start resuming."""
        run_id = cwd.rstrip("/").rsplit("/", 1)[-1]
        requeue = REQUEUE.format(max_restarts=restarts) if restarts else ""
        slots = self.prov.ranks_per_node if self.prov else 1
        ended = ENDED if restarts else ""
        batch = BATCH.format(run_id=run_id, run_dir=shlex.quote(cwd), slots=slots, requeue=requeue, ended=ended)
        if script != "launch.sh":  # slurm.sh starts launch.sh; nothing else is submitted
            raise RemoteError(f"{self.label}: cannot submit {script}")
        self.write_text(f"{cwd}/{BATCH_SCRIPT}", batch, "700")
        argv = ["sbatch", "--parsable", "--job-name", f"gpuctl-{run_id}", "--chdir", cwd, "--output", f"{cwd}/{log}"]
        argv.append("--export=" + ",".join(EXPORT))
        # Slurm requeues a batch job after a node failure by default (JobRequeue=1): only when recovery.max_restarts
        # allows it (the restart resumes; a requeued job without that would train again from step 0 over its run dir).
        # A restart appends to the log the follow has read so far (sbatch truncates it by default).
        argv += ["--requeue", "--open-mode=append"] if restarts else ["--no-requeue"]
        out = self.run([*argv, *self.options, f"{cwd}/{BATCH_SCRIPT}"], timeout=60).stdout.strip()
        match = JOB_ID.match(out.splitlines()[-1] if out else "")
        if not match:
            raise RemoteError(f"{self.label}: sbatch answered {out[:200]!r}, not a job id")
        return int(match.group(1))

    def job_state(self, job_id: int) -> tuple[str, str]:
        """(JobState, Reason) from `scontrol show job`; ("", "") once Slurm has forgotten the job."""
        result = self.run(["scontrol", "show", "job", "--oneliner", str(job_id)], check=False, timeout=30)
        if result.rc != 0:
            if "Invalid job id" in result.stderr:
                return self.accounted(job_id), ""
            raise RemoteError(f"{self.label}: scontrol show job {job_id}: {result.stderr.strip()[:200]}")
        fields = dict(JOB_FIELD.findall(result.stdout[:20_000]))
        return fields.get("JobState", ""), fields.get("Reason", "")

    def on_compute(self, argv: list[str], timeout_s: float, name: str = "doctor") -> list[str]:
        """argv as a short job on the partition (the doctor's checks, the bootstrap install: on a node the run
        would get, not the login node): srun allocates, runs it there with our stdin and releases."""
        if self.prov is None:
            return argv
        srun = ["srun", "--job-name", f"gpuctl-{name}", f"--immediate={DOCTOR_QUEUE_S}", "--export=" + ",".join(EXPORT)]
        # a login shell, as slurm.sh's: the site's profile defines `module` for provider.setup
        return [*srun, *doctor_options(self.prov, timeout_s), "bash", "-l", "-c", 'exec "$@"', "gpuctl", *argv]

    def accounted(self, job_id: int) -> str:
        """The state Slurm's accounting keeps of a job scontrol forgot (MinJobAge passed): how it
        ended (COMPLETED, TIMEOUT, PREEMPTED, ...); "" on a site without accounting."""
        argv = ["sacct", "--jobs", str(job_id), "--allocations", "--noheader", "--parsable2", "--format", "State"]
        result = self.run(argv, check=False, timeout=30)
        match = ACCT_STATE.match(result.stdout.strip()[:200]) if result.rc == 0 else None
        return match.group(1) if match else ""

    def group_alive(self, pgid: int) -> bool:
        return self.job_state(pgid)[0] in ALIVE

    def signal_group(self, pgid: int, sig: str = "TERM") -> None:
        # TERM: Slurm's own stop (TERM to every step and the batch shell, KILL after KillWait).
        argv = ["scancel", str(pgid)] if sig == "TERM" else ["scancel", "--signal", sig, "--full", str(pgid)]
        self.run(argv, check=False, timeout=30)

    def job_over(self, pgid: int) -> bool:
        # launch.sh's end is the run's only once Slurm lists the job as over: a requeued job starts it again
        return not self.group_alive(pgid)

    def drop_run_secrets(self, run_dir: str) -> None:
        """The run's secrets once its job is over for good (a requeued job's kept copy included)."""
        self.sh('rm -f -- "$1/secrets.env" "$1/secrets.keep"', run_dir.rstrip("/"), check=False, timeout=30)

    def queue_state(self, pgid: int) -> str | None:
        state_, reason = self.job_state(pgid)
        if not state_:
            return None
        return f"Slurm job {pgid} {state_}" + (f" ({reason})" if reason and reason != "None" else "")


def _gone(node: Node, job_id: int, wait_s: float = 60) -> bool:
    """Wait until Slurm lists the job as finished (scancel's TERM, KILL after KillWait)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not node.group_alive(job_id):
            return True
        time.sleep(0.5)
    return False


def _check(node: Node, prov: SlurmProvider, say: Callable[[str], None]) -> SlurmProvider:
    """The login node's checks; the provider with gpu_request decided (auto: the site's way)."""
    try:
        info = node.run(["sinfo", "--noheader", "--format", "%R %D %c %G", *_part(prov)], check=False, timeout=60)
    except (RemoteError, OSError) as exc:
        raise ConfigError(f"provider.login: Slurm does not answer ({exc})", "check that sinfo works there") from None
    if info.rc != 0:
        raise ConfigError(
            f"provider.login: sinfo failed: {info.stderr.strip()[:200]}", "check Slurm on the login node (sinfo)"
        )
    rows = [line.split() for line in info.stdout.splitlines() if line.strip()]
    if not rows:
        raise ConfigError(
            f"provider.partition {prov.partition!r} has no nodes or does not exist", "pick one `sinfo -s` lists"
        )
    count = sum(int(row[1]) for row in rows if len(row) > 1 and row[1].isdigit())
    if count < prov.nodes:
        raise ConfigError(
            f"provider.nodes is {prov.nodes} but the partition has {count} node(s)", f"set nodes to at most {count}"
        )
    if prov.gpus_per_node:
        prov = _gpu_nodes(node, prov, rows)
    test = node.run(["sbatch", "--test-only", *job_options(prov), "--wrap", "true"], check=False, timeout=60)
    if test.rc != 0:
        why = (test.stderr.strip().splitlines() or ["no reason given"])[-1][:300]
        raise ConfigError(f"provider: Slurm refuses the job shape: {why}", "fix partition/account/qos/nodes/time")
    probe = node.sh('[ -d "$1" ] && [ -w "$1" ]', prov.workdir, check=False, timeout=30)
    if probe.rc != 0:
        raise ConfigError(
            f"provider.workdir {prov.workdir} is not a writable folder on the login node",
            "give a folder on the filesystem every node shares",
        )
    gpus = (
        f"; GPUs as {'--gres gpu:N' if prov.gpu_request == 'gres' else '--gpus-per-node'}" if prov.gpus_per_node else ""
    )
    say(f"slurm: partition {rows[0][0]} with {count} node(s); sbatch --test-only accepts the job{gpus}")
    return prov


def _gpu_nodes(node: Node, prov: SlurmProvider, rows: list[list[str]]) -> SlurmProvider:
    """Enough nodes with gpus_per_node GPUs (sinfo's gres), and the site's way of asking for them."""
    assert prov.gpus_per_node
    fit = sum(
        int(row[1]) for row in rows if len(row) > 3 and row[1].isdigit() and gres_gpus(row[3]) >= prov.gpus_per_node
    )
    if fit < prov.nodes:
        most = max((gres_gpus(row[3]) for row in rows if len(row) > 3), default=0)
        raise ConfigError(
            f"provider.gpus_per_node is {prov.gpus_per_node} but {fit} node(s) of the partition have that many "
            f"GPUs (sinfo's gres shows at most {most})",
            f"set gpus_per_node to at most {most}, or pick a partition with bigger nodes",
        )
    if prov.gpu_request != "auto":
        return prov
    shown = node.run(["scontrol", "show", "config"], check=False, timeout=60)
    return prov.model_copy(update={"gpu_request": site_gpu_request(shown.stdout if shown.rc == 0 else "")})


def _part(prov: SlurmProvider) -> list[str]:
    return ["--partition", prov.partition] if prov.partition else []


def planned(cfg: GpuctlConfig) -> state.ClusterRecord:
    prov = cfg.provider
    assert isinstance(prov, SlurmProvider)
    return state.ClusterRecord(
        name=cfg.cluster_name,
        provider="slurm",
        nodes=[login_record(prov)],
        python=prov.python,
        identity_file=identity(prov, cfg.base_dir),
        slurm=prov,
    )


class SlurmBackend(ProviderBackend):
    def up(self, cfg: GpuctlConfig, opts: UpOptions) -> state.ClusterRecord | None:
        prov = cfg.provider
        assert isinstance(prov, SlurmProvider)
        record = planned(cfg)
        node = login_node(record.nodes[0], record.identity_file, pin_new=True)  # pins the login's key
        try:
            record.slurm = _check(node, prov, opts.say)  # jobs ask for GPUs the way this site does
            if prov.runtime == "bootstrap" and not opts.dry_run:
                from provision.providers.bootstrap import install_on_slurm

                record.python = install_on_slurm(SlurmNode(node, [], record.slurm), record, opts.say)
        finally:
            node.close()
        return None if opts.dry_run else record

    def nodes(self, cluster: state.ClusterRecord) -> list[Node]:
        prov = cluster.slurm
        if prov is None:
            raise ConfigError(f"cluster {cluster.name}: the record lacks its slurm section", "`gpuctl up` it again")
        return [SlurmNode(login_node(cluster.nodes[0], cluster.identity_file), job_options(prov), prov)]

    def down(self, cluster: state.ClusterRecord, say: Callable[[str], None]) -> None:
        """Cancel every job of the cluster's runs that Slurm still lists; nothing else is held."""
        (node,) = self.nodes(cluster)
        try:
            jobs = [run.pgid for run in state.list_runs(cluster.name) if run.pgid and node.group_alive(run.pgid)]
            for job_id in jobs:
                node.signal_group(job_id)
            left = [job_id for job_id in jobs if node.group_alive(job_id) and not _gone(node, job_id)]
            if left:
                raise RemoteError(f"slurm: job(s) {', '.join(map(str, left))} still listed after scancel")
            gone = node.remove_run_secrets(cluster.nodes[0].workdir)
        finally:
            node.close()
        if gone:
            say(f"slurm: removed {gone} run secrets file(s) a cancelled job left behind")
        say(f"slurm: cancelled {len(jobs)} job(s); nothing is held while idle")

    def self_teardown(self, cluster: state.ClusterRecord) -> SelfTeardown | None:
        return None


BACKEND = SlurmBackend()

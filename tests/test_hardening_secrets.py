"""`secrets:` in gpuctl.yaml: names read from the laptop's environment at `train`, handed to the
ranks only through the node's 0600 secrets.env, which is created 0600 (never chmod'ed after the
bytes are in) and removed on every exit path: at once on one node, by an EXIT trap (and the
trainer) on several, and by `gpuctl down` after a kill -9."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import paramiko
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from provision.cli.app import app
from provision.core import state
from provision.core.config import GpuctlConfig, load_config
from provision.core.errors import ConfigError
from provision.core.provider_config import SSHProvider
from provision.flows import job
from provision.flows.render import BundleNode, BundleSpec, render_bundle
from provision.transport.remote import LocalNode
from provision.transport.ssh.node import SSHNode
from trainer.config import TrainerError

pytestmark = pytest.mark.timeout(120)
TOKEN = "hf_TOKEN-" + hashlib.sha256(b"gpuctl-secret-test").hexdigest()[:24]
RUNNER = CliRunner()


def leaks(token: str, *roots: Path) -> list[str]:
    needle = token.encode()
    return [
        str(p)
        for root in roots
        for p in Path(root).rglob("*")
        if p.is_file() and not p.is_symlink() and needle in p.read_bytes()
    ]


class ArgvWatch:
    """Samples every process's argv (/proc/*/cmdline) while a run goes on; records any holding a token,
    and how many samples caught a process whose argv holds `during` (proof that it watched the run)."""

    def __init__(self, *tokens: str, during: bytes | None = None):
        self.tokens, self.hits, self.samples = [t.encode() for t in tokens], [], 0
        self.during, self.caught = during, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            self.samples += 1
            caught = False
            for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
                try:
                    argv = cmdline.read_bytes()
                except OSError:
                    continue
                caught = caught or (self.during is not None and self.during in argv)
                if any(token in argv for token in self.tokens):
                    self.hits.append(argv.replace(b"\0", b" ").decode(errors="replace")[:300])
            self.caught += caught
            if self._stop.wait(0.2):
                return


def test_secret_names_are_checked():
    for bad, why in [
        (["9LIVES"], "not a valid variable name"),
        (["GPUCTL_TEARDOWN_KEY"], "gpuctl sets itself"),
        (["AWS_SECRET_ACCESS_KEY"], "gpuctl sets itself"),
        (["HF_TOKEN", "HF_TOKEN"], "listed twice"),
    ]:
        with pytest.raises(ValueError, match=why):
            GpuctlConfig(secrets=bad)
    with pytest.raises(ValueError, match="in both env and secrets"):
        GpuctlConfig(secrets=["HF_TOKEN"], env={"HF_TOKEN": "x"})
    assert GpuctlConfig(secrets=["HF_TOKEN", "WANDB_API_KEY"]).secrets == ["HF_TOKEN", "WANDB_API_KEY"]


def test_the_values_come_from_this_shell_and_a_missing_one_is_one_line():
    from provision.core.credentials import user_secrets

    assert user_secrets(["HF_TOKEN"], {"HF_TOKEN": TOKEN}) == {"HF_TOKEN": TOKEN}
    with pytest.raises(ConfigError) as err:
        user_secrets(["HF_TOKEN", "WANDB_API_KEY"], {"WANDB_API_KEY": "w"})
    assert "secrets: HF_TOKEN is not set in this shell" in err.value.one_line()


def two_node_cluster(tmp_path: Path) -> tuple[GpuctlConfig, state.ClusterRecord]:
    cfg = GpuctlConfig(
        provider=SSHProvider(hosts=["u@10.0.0.1", "u@10.0.0.2"], cpu_ranks=1),
        secrets=["HF_TOKEN"],
        base_dir=tmp_path,
    )
    nodes = [
        state.NodeRecord(host=h, address=h, user="u", slots=1, workdir=str(tmp_path / "node"))
        for h in ("10.0.0.1", "10.0.0.2")
    ]
    return cfg, state.ClusterRecord(name="two", provider="ssh", nodes=nodes)


def test_the_bundle_holds_the_token_only_in_its_0600_secrets_env(project, tmp_path):
    cfg, cluster = two_node_cluster(tmp_path)
    spec = job.bundle_spec(cfg, cluster, "r1", secrets_env={"HF_TOKEN": TOKEN})
    out = render_bundle(cfg, spec, tmp_path / "bundle")
    assert leaks(TOKEN, out) == [str(out / "secrets.env")]
    assert stat.S_IMODE((out / "secrets.env").stat().st_mode) == 0o600
    script = (out / "launch.sh").read_text()
    assert "--venv_script" not in script and "trap 'rm -f secrets.env' EXIT" in script
    # `gpuctl render` never carries a user token into a folder the user keeps
    (project / "gpuctl.yaml").write_text(yaml.safe_dump({"secrets": ["HF_TOKEN"]}))
    rendered = RUNNER.invoke(app, ["render", "-o", str(project / "kept")], env={"HF_TOKEN": TOKEN})
    assert rendered.exit_code == 0, rendered.output
    assert (project / "kept" / "launch.sh").is_file() and leaks(TOKEN, project / "kept") == []


def run_launch_sh(
    tmp_path: Path, nodes: int, launcher: str, setup: str | None = None, after: list[str] | None = None
) -> Path:
    """launch.sh for real, its DeepSpeed launcher replaced by a bash stand-in (bundle like test_budget_watchdog)."""
    out = tmp_path / "run"
    spec = BundleSpec(
        run_id="sec",
        run_dir=str(out),
        nodes=[BundleNode(f"n{i}", 1) for i in range(nodes)],
        python=sys.executable,
        launcher_prefix=["bash", "-c", launcher, "stand-in"],
        secrets={"HF_TOKEN": TOKEN},
        setup=setup,
        after_run=[after] if after else [],
    )
    render_bundle(GpuctlConfig(base_dir=tmp_path), spec, out)
    with open(out / "job.log", "w") as log:
        subprocess.run(
            ["setsid", "bash", "launch.sh"], cwd=out, stdout=log, stderr=subprocess.STDOUT, timeout=60, check=False
        )
    return out


def test_the_launcher_never_holds_the_token_its_ranks_find_the_file_and_it_goes(tmp_path):
    """One node and two: the launcher (DeepSpeed's runner, which copies MLFLOW*/PYTHON*/... variables onto
    pdsh's command line) starts without the token and finds the 0600 file for its ranks; the node's setup
    command gets it; the file is gone when launch.sh ends."""
    sha = hashlib.sha256(TOKEN.encode()).hexdigest()
    probe = (
        'printf "%s" "${HF_TOKEN:-}" | sha256sum | cut -c1-64 > seen.sha;'
        " [ -e secrets.env ] && echo present > file.state || echo gone > file.state;"
        " sleep 1"  # long enough for the argv watcher to see every process of the run
    )
    setup = 'printf "%s" "$HF_TOKEN" | sha256sum | cut -c1-64 > setup.sha'
    after = ["bash", "-c", 'printf "%s" "$HF_TOKEN" | sha256sum | cut -c1-64 > after.sha']  # e.g. self-teardown
    for nodes in (1, 2):
        with ArgvWatch(TOKEN) as argv:
            out = run_launch_sh(tmp_path / str(nodes), nodes, probe, setup=setup, after=after)
        assert (out / "seen.sha").read_text().strip() == hashlib.sha256(b"").hexdigest()
        assert (out / "setup.sha").read_text().strip() == sha and (out / "after.sha").read_text().strip() == sha
        assert (out / "file.state").read_text().strip() == "present"
        assert json.loads((out / "status.json").read_text())["state"] == "succeeded"
        assert not (out / "secrets.env").exists()
        assert argv.samples >= 3 and argv.hits == []
        assert leaks(TOKEN, out) == []


def test_a_rank_reads_the_file_as_bash_would(tmp_path):
    """trainer/secrets_file.py parses what render writes (shlex.quote) to the values bash's `.` gives."""
    from trainer.secrets_file import load, parse

    values = {"A": "plain", "B": 'it\'s $(rm -rf /) `x` \\ "q"', "C": "two\nlines", "D": "", "E": "x=y"}
    spec = BundleSpec(run_id="p", run_dir=str(tmp_path), nodes=[BundleNode("n0", 1)], python="python3", secrets=values)
    out = render_bundle(GpuctlConfig(base_dir=tmp_path), spec, tmp_path / "b")
    text = (out / "secrets.env").read_text()
    assert parse(text) == values
    shown = subprocess.run(
        ["bash", "-c", ". ./secrets.env; for n in A B C D E; do printf '%s\\0' \"${!n}\"; done"],
        cwd=out,
        capture_output=True,
        check=True,
    )
    assert shown.stdout.decode().split("\0")[:-1] == list(values.values())
    before = dict(os.environ)
    try:
        assert load(out) == sorted(values) and os.environ["B"] == values["B"]
    finally:
        os.environ.clear()
        os.environ.update(before)
    for bad in ("A='open", "9X=1", "no-equals-sign"):
        (out / "secrets.env").write_text(bad)
        with pytest.raises(TrainerError) as err:
            load(out)
        assert "open" not in str(err.value) and "equals" not in str(err.value)
    assert load(tmp_path / "nowhere") == []


NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True)


@given(st.dictionaries(NAMES, st.text(st.characters(exclude_characters="\0", exclude_categories=["Cs"])), max_size=8))
def test_every_value_render_writes_is_read_back(values):
    from provision.flows.render import secrets_text
    from trainer.secrets_file import parse

    assert parse(secrets_text(values)) == values


def test_several_nodes_a_run_that_dies_early_still_removes_the_file(tmp_path):
    out = run_launch_sh(tmp_path, 2, "true", setup="exit 3")  # the setup command fails: exit 98
    assert json.loads((out / "status.json").read_text())["exit_code"] == 98
    assert not (out / "secrets.env").exists()
    assert leaks(TOKEN, out) == []


def test_sftp_gives_secrets_env_its_mode_before_the_first_byte(sshd, tmp_path, monkeypatch):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    secret = bundle / "secrets.env"
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, f"HF_TOKEN={TOKEN}\n".encode())
    os.close(fd)
    (bundle / "launch.sh").write_text("echo hi\n")
    modes: list[int] = []
    real_write = paramiko.SFTPFile.write

    def write(self, data):
        if TOKEN.encode() in bytes(data) and not modes:
            modes.append(stat.S_IMODE(self.stat().st_mode))  # what the node's file is as the token arrives
        return real_write(self, data)

    monkeypatch.setattr(paramiko.SFTPFile, "write", write)
    remote = tmp_path / "node" / "run"
    node = SSHNode("127.0.0.1", sshd.port, sshd.user, str(sshd.client_key), pin_new=True)
    try:
        node.put_dir(bundle, str(remote))
    finally:
        node.close()
    assert modes == [0o600]
    assert stat.S_IMODE((remote / "secrets.env").stat().st_mode) == 0o600


def test_the_local_node_copy_creates_files_with_their_mode(tmp_path, monkeypatch):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    fd = os.open(bundle / "secrets.env", os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, TOKEN.encode())
    os.close(fd)
    target = tmp_path / "node"
    real_chmod = os.chmod

    def chmod(path, mode, *args, **kw):
        if str(target) in str(path) and os.path.isfile(path):  # (folders: copytree's copystat, harmless)
            raise AssertionError(f"{path} was chmod'ed after it was written")
        return real_chmod(path, mode, *args, **kw)

    monkeypatch.setattr(os, "chmod", chmod)
    LocalNode().put_dir(bundle, str(target))
    assert stat.S_IMODE((target / "secrets.env").stat().st_mode) == 0o600


def test_down_removes_what_a_killed_run_left(project, state_dir):
    (project / "gpuctl.yaml").write_text(yaml.safe_dump({"storage": {"url": "./store"}}))
    assert RUNNER.invoke(app, ["up"]).exit_code == 0
    left = state_dir / "local-node" / "runs" / "20260101-000000-dead" / "secrets.env"
    left.parent.mkdir(parents=True)
    left.write_text(f"HF_TOKEN={TOKEN}\n")  # launch.sh was killed with -9 before its ranks were up
    result = RUNNER.invoke(app, ["down", "--yes"])
    assert result.exit_code == 0, result.output
    assert not left.exists() and "removed 1 run secrets file(s)" in result.stderr


def test_train_without_the_variable_is_one_line_and_starts_nothing(project, state_dir, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    (project / "gpuctl.yaml").write_text(yaml.safe_dump({"storage": {"url": "./store"}, "secrets": ["HF_TOKEN"]}))
    assert RUNNER.invoke(app, ["up"]).exit_code == 0
    result = RUNNER.invoke(app, ["train"])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert "secrets: HF_TOKEN is not set in this shell" in result.stderr
    assert not list(state_dir.glob("runs/*.json"))


SITECUSTOMIZE = """
import atexit, hashlib, json, os
NAMES = os.environ.get("GPUCTL_TEST_SECRET_NAMES", "HF_TOKEN").split(",")


def _leaks(tokens):
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                argv = open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                continue
            found += [pid for token in tokens if token and token.encode() in argv]
    return found


def _report(at_start):  # at exit: the trainer has loaded secrets.env by then (trainer/secrets_file.py)
    seen = {n: hashlib.sha256(os.environ.get(n, "").encode()).hexdigest() for n in NAMES}
    report = {"seen": seen, "argv_leaks": _leaks([os.environ.get(n, "") for n in NAMES]), **at_start,
              "file_at_exit": os.path.exists("secrets.env")}
    with open(os.path.join(os.path.dirname(__file__), "rank%s.json" % os.environ["RANK"]), "w") as out:
        json.dump(report, out)


if "RANK" in os.environ and "LOCAL_RANK" in os.environ:  # a training rank, not the launcher
    atexit.register(_report, {"env_at_start": sorted(n for n in NAMES if n in os.environ),
                              "file_at_start": os.path.exists("secrets.env")})
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_secret_reaches_every_rank_and_nothing_else(gpuctl, project, state_dir, tmp_path):
    pytest.importorskip("deepspeed")
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)  # runs at start-up in every rank
    cfg = {
        "storage": {"url": "./store"},
        # torch's Adam: what is checked is the secret's way to the ranks, not DeepSpeed's CPU Adam op
        "train": {"max_steps": 2, "checkpoint_every": 0, "seq_len": 32, "offload_optimizer": "none"},
        "secrets": ["HF_TOKEN"],
        "env": {
            "PYTHONPATH": f"lib:{hook}",  # lib: the run dir's trainer copy, as launch.sh sets it
            "TORCH_EXTENSIONS_DIR": os.environ["TORCH_EXTENSIONS_DIR"],
        },
    }
    (project / "gpuctl.yaml").write_text(yaml.safe_dump(cfg))
    env = {"HF_TOKEN": TOKEN}
    assert gpuctl("up", env=env).returncode == 0
    with ArgvWatch(TOKEN) as argv:
        train = gpuctl("train", env=env)
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    ranks = [json.loads(p.read_text()) for p in sorted(hook.glob("rank*.json"))]
    assert len(ranks) == load_config(project / "gpuctl.yaml").provider.cpu_ranks
    for seen in ranks:
        assert seen["seen"] == {"HF_TOKEN": hashlib.sha256(TOKEN.encode()).hexdigest()}, seen
        assert seen["file_at_start"] and not seen["file_at_exit"] and seen["argv_leaks"] == [], seen
    assert argv.samples > 3 and argv.hits == []
    assert [o for o in gpuctl.outputs if TOKEN in o] == []
    assert leaks(TOKEN, state_dir, project) == []  # job.log, bundles, records, the node's run dir
    assert gpuctl("down", "--yes").returncode == 0

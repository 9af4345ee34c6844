"""Storage credentials: resolved on the laptop (boto3's chain), handed to the node in secrets.env
only; multi-node ranks get them without .deepspeed_env (which DeepSpeed puts on the pdsh command
line and into job.log). Also the laptop's resume check. Fast: no DeepSpeed ranks, no server."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from provision.core import state
from provision.core.config import GpuctlConfig
from provision.core.credentials import storage_credentials
from provision.core.errors import ConfigError, NotFoundError
from provision.flows import job, resume
from provision.flows.render import launcher_argv, render_bundle

MARKER = "SECRETmarker0123456789abcdefSECRET"


def aws_files(tmp_path: Path, profile: str = "train-profile", token: str | None = None) -> dict[str, str]:
    creds = tmp_path / "credentials"
    lines = [f"[{profile}]", "aws_access_key_id = AKIAPROFILEKEY000001", f"aws_secret_access_key = {MARKER}"]
    if token:
        lines.append(f"aws_session_token = {token}")
    creds.write_text("\n".join(lines) + "\n")
    config = tmp_path / "config"
    config.write_text(f"[profile {profile}]\nregion = eu-west-3\n")
    return {"AWS_SHARED_CREDENTIALS_FILE": str(creds), "AWS_CONFIG_FILE": str(config)}


@pytest.fixture
def profile_env(s3_env, tmp_path):
    """Credentials only in a named profile: nothing in the environment."""
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        s3_env.delenv(var, raising=False)
    for key, value in aws_files(tmp_path).items():
        s3_env.setenv(key, value)
    return s3_env


def config(storage: dict, **provider) -> GpuctlConfig:
    return GpuctlConfig.model_validate({"provider": {"kind": "local", "cpu_ranks": 3, **provider}, "storage": storage})


S3 = {"url": "s3://bucket/prefix", "endpoint_url": "http://127.0.0.1:9", "profile": "train-profile"}


def test_profile_credentials_become_plain_env(profile_env):
    creds = storage_credentials(config(S3).storage)
    assert creds.env == {
        "AWS_ACCESS_KEY_ID": "AKIAPROFILEKEY000001",
        "AWS_SECRET_ACCESS_KEY": MARKER,
        "AWS_DEFAULT_REGION": "eu-west-3",
    }
    assert not creds.expires and MARKER not in repr(creds)


def test_env_credentials_with_session_token_and_region(s3_env):
    s3_env.setenv("AWS_SESSION_TOKEN", "tok-" + MARKER)
    creds = storage_credentials(config({"url": "s3://b/p", "region": "ap-south-1"}).storage)
    assert creds.env["AWS_SESSION_TOKEN"] == "tok-" + MARKER
    assert creds.env["AWS_DEFAULT_REGION"] == "ap-south-1"  # storage.region wins over the env's
    assert creds.expires and creds.method == "env"


def test_file_storage_needs_no_credentials(s3_env):
    assert storage_credentials(config({"url": "/tmp/store"}).storage).env == {}


def test_s3_training_data_brings_credentials_with_file_storage(s3_env):
    creds = storage_credentials(config({"url": "/tmp/store"}).storage, "s3://bucket/corpus.jsonl")
    assert set(creds.env) >= {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}


def test_missing_profile_and_missing_credentials_are_one_line_errors(profile_env):
    with pytest.raises(ConfigError, match="storage.profile 'nope'") as err:
        storage_credentials(config({**S3, "profile": "nope"}).storage)
    assert MARKER not in err.value.one_line()
    with pytest.raises(ConfigError, match="no AWS credentials found for storage s3://bucket/prefix"):
        storage_credentials(config({"url": "s3://bucket/prefix"}).storage)  # default profile: none


def _bundle(cfg: GpuctlConfig, tmp_path: Path, hosts: int = 1):
    cluster = state.ClusterRecord(
        name="c",
        provider="local",
        python="python3",
        nodes=[
            state.NodeRecord(host=f"node{i}", address=f"127.0.0.{i + 1}", slots=1, workdir=str(tmp_path / "node"))
            for i in range(hosts)
        ],
    )
    spec = job.bundle_spec(cfg, cluster, "run1", "latest")
    spec.ssh_config = None  # multi-node: mesh.setup would have written one at `up`
    return spec, render_bundle(cfg, spec, tmp_path / "bundle")


def test_bundle_carries_credentials_only_in_secrets_env(profile_env, tmp_path):
    spec, out = _bundle(config(S3), tmp_path)
    run = json.loads((out / "run.json").read_text())
    assert run["storage"]["profile"] is None and run["storage"]["url"] == "s3://bucket/prefix"
    assert run["resume"] == "latest"
    secrets = out / "secrets.env"
    assert oct(secrets.stat().st_mode & 0o777) == "0o600"
    assert f"AWS_SECRET_ACCESS_KEY={MARKER}" in secrets.read_text().splitlines()
    others = [p for p in out.rglob("*") if p.is_file() and p != secrets]
    assert not [p for p in others if MARKER.encode() in p.read_bytes()]
    assert MARKER not in " ".join(launcher_argv(spec))
    assert "--venv_script" not in launcher_argv(spec)


def test_render_command_writes_no_credentials(profile_env, tmp_path):
    from typer.testing import CliRunner

    from provision.cli.app import app

    (tmp_path / "gpuctl.yaml").write_text(json.dumps({"provider": {"kind": "local"}, "storage": S3}))
    result = CliRunner().invoke(app, ["render", "-o", str(tmp_path / "out"), "-c", str(tmp_path / "gpuctl.yaml")])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "out" / "secrets.env").exists()


def test_multinode_ranks_read_secrets_without_command_line_or_log(profile_env, tmp_path):
    """DeepSpeed's pdsh command (what it logs and runs on every node), built by its own classes from our
    argv, .deepspeed_env and the environment launch.sh gives it, carries no secret; each node's rank
    reads that node's secrets.env itself, and local rank 0 deletes it (a shared run dir: one file)."""
    spec, out = _bundle(config(S3), tmp_path, hosts=2)
    argv = launcher_argv(spec)
    assert "--venv_script" not in argv
    assert MARKER not in (out / ".deepspeed_env").read_text()
    assert oct((out / ".deepspeed_env").stat().st_mode & 0o777) == "0o600"

    # The launcher's environment: launch.sh up to the launcher, which is replaced by `env`.
    shutil.copytree(out, spec.run_dir)
    launch = Path(spec.run_dir, "launch.sh")
    assert shlex.join(argv) in launch.read_text()
    launch.write_text(launch.read_text().replace(shlex.join(argv), "env -0 > launcher.env; true"))
    clean = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/")}
    subprocess.run(["bash", "launch.sh"], cwd=spec.run_dir, env=clean, timeout=60, check=True, capture_output=True)
    seen = dict(v.split("=", 1) for v in Path(spec.run_dir, "launcher.env").read_text().split("\0") if v)
    assert MARKER not in "".join(seen.values()) and "AWS_SECRET_ACCESS_KEY" not in seen
    assert not Path(spec.run_dir, "secrets.env").exists()  # the EXIT trap, as the run ended

    pytest.importorskip("deepspeed")
    from deepspeed.launcher.multinode_runner import PDSHRunner
    from deepspeed.launcher.runner import EXPORT_ENVS, parse_args

    args = parse_args(
        argv[argv.index("deepspeed.launcher.runner") + 1 :]
        + ["--master_port", "29500", "--module", "trainer", "run.json"]
    )
    runner = PDSHRunner(args, "e30=")
    for key, value in seen.items():  # what runner.main adds from its environment (CUDA: NCCL too)
        if key.startswith((*EXPORT_ENVS, "NCCL")):
            runner.add_export(key, value)
    for line in (out / ".deepspeed_env").read_text().splitlines():
        runner.add_export(*line.split("=", 1))
    cmd, _kill, _env = runner.get_cmd(dict(seen), {"node0": [0], "node1": [0]})
    assert MARKER not in " ".join(cmd)

    # The node side: a rank loads its node's copy; once every rank is up, local rank 0 deletes it.
    from trainer.config import DistEnv
    from trainer.secrets_file import drop, load

    node = tmp_path / "node1-run"
    shutil.copytree(out, node)
    before = dict(os.environ)
    try:
        assert "AWS_SECRET_ACCESS_KEY" in load(node) and os.environ["AWS_SECRET_ACCESS_KEY"] == MARKER
    finally:
        os.environ.clear()
        os.environ.update(before)
    drop(node, DistEnv(rank=1, local_rank=1, world_size=2, local_world_size=2))
    assert (node / "secrets.env").exists()
    drop(node, DistEnv(rank=0, local_rank=0, world_size=2, local_world_size=2))
    assert not (node / "secrets.env").exists()


def test_launch_sh_removes_secret_files_at_the_end(profile_env, tmp_path):
    _spec, out = _bundle(config(S3), tmp_path)
    assert "rm -f secrets.env .deepspeed_env" in (out / "launch.sh").read_text()


# -- the laptop's resume check ---------------------------------------------------------------
def _store_with(tmp_path: Path, tags: dict[str, int]):
    from trainer.objstore.store import CheckpointStore

    store = CheckpointStore.from_config({"url": str(tmp_path / "store")})
    for tag, world in tags.items():
        local = tmp_path / "ckpt" / tag
        local.mkdir(parents=True)
        (local / "mp_rank_00_model_states.pt").write_bytes(tag.encode() * 10)
        store.upload_shards(local, tag, 0)
        assert store.publish(tag, int(tag[4:]), world, 1, timeout=5)
    return store


def _cluster(world: int) -> state.ClusterRecord:
    return state.ClusterRecord(name="c", provider="local", nodes=[state.NodeRecord(host="localhost", slots=world)])


def test_resume_check_world_size_and_missing(tmp_path):
    cfg = config({"url": str(tmp_path / "store")})
    lines: list[str] = []
    with pytest.raises(NotFoundError, match="no complete checkpoint in"):
        resume.check_resume(cfg, _cluster(3), "latest", lines.append)
    _store_with(tmp_path, {"step4": 3, "step8": 3})
    resume.check_resume(cfg, _cluster(3), "latest", lines.append)
    assert lines[-1].startswith("resuming from step8 (step 8)")
    with pytest.raises(ConfigError, match="saved by 3 ranks but cluster c has 2") as err:
        resume.check_resume(cfg, _cluster(2), "step4", lines.append)
    assert "--hf" in err.value.one_line()
    resume.check_resume(cfg, _cluster(3), "step6", lines.append)  # not there: the node falls back
    assert lines[-2] == f"checkpoint step6 is not complete in {cfg.storage_url()}; the node will fall back to step4"
    with pytest.raises(NotFoundError):
        resume.check_resume(cfg, _cluster(3), "step2", lines.append)
    with pytest.raises(ConfigError, match="invalid checkpoint tag"):
        resume.check_resume(cfg, _cluster(3), "../x", lines.append)
    resume.check_resume(cfg, _cluster(3), None, lines.append)  # fresh run: nothing to check


def test_export_without_a_checkpoint_is_one_line(tmp_path):
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.export",
            str(tmp_path / "none"),
            "step3",
            str(tmp_path / "hf"),
            "--model",
            "tiny",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert (
        out.stderr.strip().splitlines()[-1] == f"export: error: checkpoint {tmp_path / 'none' / 'step3'} does not exist"
    )
    assert not (tmp_path / "hf").exists()

"""gpuctl.yaml and state records that are wrong in every way a person (or a fuzzer) can make them.

Fixed cases: a key given twice, non-finite and absurd numbers, `plan --gpu-mem nan`. Then a
property test (hypothesis): gpuctl.yaml from arbitrary bytes and from mutated valid configs, and
corrupt state records, fed to `render`, `status`, `down` and `ckpt ls` through typer's CliRunner:
a failure is always one `error: ... (fix: ...)` line naming the file (and the field), never a
traceback, and no state record changes.
"""

from __future__ import annotations

import copy
import json
import math
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from provision.cli.app import app
from provision.core.config import load_config
from provision.core.errors import ConfigError
from provision.flows.init_config import config_text

pytestmark = pytest.mark.timeout(300)
RUNNER = CliRunner()
COMMANDS = (["render", "-o", "{out}"], ["status"], ["down", "--yes"], ["ckpt", "ls"])


def one_error_line(result) -> str:
    assert isinstance(result.exception, SystemExit), repr(result.exception)  # mapped, never a traceback
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "(fix: " in errors[0], result.stderr
    return errors[0]


# --- fixed cases ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, where",
    [
        (
            "provider:\n  kind: vast\n  max_hours: 1\n  max_hours: 100\n",
            "key 'max_hours' appears twice (first on line 3)",
        ),
        ("train: {max_steps: 5, max_steps: 50}\n", "key 'max_steps' appears twice"),
        ("name: a\nname: b\n", "key 'name' appears twice (first on line 1)"),
    ],
)
def test_a_key_given_twice_is_refused(project, text, where):
    (project / "gpuctl.yaml").write_text(text)
    line = one_error_line(RUNNER.invoke(app, ["render", "-o", "out"]))
    assert where in line and "gpuctl.yaml" in line and "keep one of them" in line


@pytest.mark.parametrize(
    "text, field",
    [
        ("train:\n  max_steps: 1.0e+32\n", "train.max_steps"),
        ("train:\n  max_steps: 100000000000000000000000000000000\n", "train.max_steps"),
        ("provider:\n  kind: vast\n  max_hours: .inf\n", "provider.max_hours"),
        ("provider:\n  kind: vast\n  max_cost: .nan\n", "provider.max_cost"),
        ("train:\n  lr: .nan\n", "train.lr"),
        ("train:\n  grad_clip: .inf\n", "train.grad_clip"),
        ("train:\n  seed: 99999999999999999999\n", "train.seed"),
        ("storage:\n  keep: 1000000\n", "storage.keep"),
        ("provider:\n  kind: aws\n  price_per_hour: .inf\n", "provider.price_per_hour"),
    ],
)
def test_non_finite_and_absurd_numbers_are_refused(project, text, field):
    (project / "gpuctl.yaml").write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(project / "gpuctl.yaml")
    assert f"gpuctl.yaml: {field}:" in err.value.one_line()


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "1e9"])
def test_plan_refuses_a_gpu_memory_that_is_no_number_of_gigabytes(project, value):
    result = RUNNER.invoke(app, ["plan", "--gpu-mem", value, "--json"])
    assert result.exit_code == 2 and "NaN" not in result.stdout and "Infinity" not in result.stdout
    assert "gpu_mem_gb must be a number" in one_error_line(result)


def test_plan_json_is_always_strict_json(project):
    result = RUNNER.invoke(app, ["plan", "--gpu-mem", "24", "--json"])
    assert result.exit_code == 0, result.output
    json.loads(result.stdout, parse_constant=lambda c: pytest.fail(f"{c} in plan --json"))


# --- the property test ------------------------------------------------------------------------------


def template() -> dict:
    return yaml.safe_load(config_text("local"))


def paths(tree: object, prefix: tuple = ()) -> list[tuple]:
    """Every key path of a nested mapping."""
    if not isinstance(tree, dict):
        return [prefix] if prefix else []
    out = [prefix] if prefix else []
    for key, value in tree.items():
        out += paths(value, (*prefix, key))
    return out


SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**40), max_value=10**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
    st.sampled_from(["s3://", "s3://b/p", "../..", "~", "vast", "aws", "ssh", "local", "\x00", "1e32", ".inf"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


PROVIDERS = [
    None,  # the template's own: local
    {"kind": "ssh", "hosts": ["ubuntu@10.0.0.1:2222", "ubuntu@10.0.0.2"], "cpu_ranks": 2},
    {"kind": "vast", "max_hours": 1.5, "nodes": 2},
    {"kind": "runpod", "max_cost": 20, "interruptible": True},
    {"kind": "aws", "max_hours": 2, "price_per_hour": 5.5},
]


@st.composite
def mutated_configs(draw) -> str:
    cfg = template()
    provider = draw(st.sampled_from(PROVIDERS))
    if provider is not None:
        cfg["provider"] = dict(provider)
    # (storage.url stays: a fuzzed "/" would make `ckpt ls` walk the whole disk, which is correct but slow)
    where = draw(st.sampled_from([p for p in paths(cfg) if p != ("storage", "url")]))
    parent = cfg
    for key in where[:-1]:
        parent = parent[key]
    action = draw(st.sampled_from(["replace", "delete", "add"]))
    if action == "replace":
        parent[where[-1]] = draw(VALUES)
    elif action == "delete":
        del parent[where[-1]]
    else:
        parent[draw(st.text(min_size=1, max_size=12))] = draw(VALUES)
    return yaml.safe_dump(cfg, allow_unicode=True)


def isolated_env(root: Path) -> dict[str, str]:
    """No cloud is reachable from a fuzzed config: S3 calls are refused at once on loopback."""
    return {
        "GPUCTL_STATE_DIR": str(root / "state"),
        "HOME": str(root / "home"),
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
        "AWS_ACCESS_KEY_ID": "fuzz",
        "AWS_SECRET_ACCESS_KEY": "fuzz",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": str(root / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(root / "none"),
        "VAST_API_KEY": "fuzz",
        "RUNPOD_API_KEY": "fuzz",
        "GPUCTL_DEBUG": "",
    }


def snapshot(state: Path) -> dict[str, bytes]:
    """The records in a state dir (the per-cluster lock files `up`/`down` take are not records)."""
    return {
        p.relative_to(state).as_posix(): p.read_bytes()
        for p in state.rglob("*")
        if p.is_file() and p.parts[len(state.parts)] not in ("locks", "lock") and not p.name.endswith(".lock")
    }


def check_commands(config: Path, root: Path) -> None:
    """Every command: success, or one error line; a config error names the file; records unchanged."""
    try:
        load_config(config)
        config_error = None
    except ConfigError as err:
        config_error = err.one_line()
    before = snapshot(root / "state")
    for command in COMMANDS:
        argv = [a.replace("{out}", str(root / "out")) for a in command]
        result = RUNNER.invoke(app, [*argv, "-c", str(config)], env=isolated_env(root))
        assert isinstance(result.exception, (SystemExit, type(None))), (argv, repr(result.exception))
        if config_error is not None:
            assert result.exit_code == 2 and one_error_line(result) == f"error: {config_error}", argv
            assert str(config) in config_error or config.name in config_error
        elif result.exit_code != 0:
            one_error_line(result)
        assert snapshot(root / "state") == before, argv


FUZZ = settings(
    max_examples=25,
    deadline=10_000,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=True,
)


@FUZZ
@given(data=st.binary(max_size=300))
def test_config_from_arbitrary_bytes(data):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config = root / "gpuctl.yaml"
        config.write_bytes(data)
        check_commands(config, root)


@FUZZ
@given(text=mutated_configs())
def test_mutated_valid_configs(text):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config = root / "gpuctl.yaml"
        config.write_text(text)
        check_commands(config, root)


def valid_cluster(name: str) -> dict:
    return {
        "name": name,
        "provider": "local",
        "created_at": 1.0,
        "nodes": [{"host": "localhost", "slots": 3, "workdir": "/nonexistent/gpuctl-fuzz"}],
        "python": "python3",
    }


def valid_run(cluster: str) -> dict:
    return {
        "run_id": "20260101-000000-fuzz",
        "cluster": cluster,
        "run_dir": "/nonexistent/gpuctl-fuzz/runs/x",
        "bundle_dir": "/nonexistent",
        "world_size": 3,
        "train_batch_size": 12,
        "micro_batch": 1,
        "grad_accum": 4,
        "max_steps": 4,
        "state": "running",
    }


@st.composite
def corrupt_record(draw, record: dict) -> bytes:
    how = draw(st.sampled_from(["truncate", "wrong type", "unknown provider", "bytes"]))
    if how == "truncate":
        text = json.dumps(record)
        return text[: draw(st.integers(min_value=0, max_value=len(text) - 1))].encode()
    if how == "bytes":
        return draw(st.binary(max_size=200).filter(lambda b: not b.strip().startswith(b"{")))
    broken = copy.deepcopy(record)
    if how == "unknown provider" and "provider" in broken:
        broken["provider"] = draw(
            st.text(min_size=1, max_size=10).filter(lambda t: t not in ("local", "ssh", "vast", "runpod", "aws"))
        )
    else:
        key = draw(st.sampled_from(sorted(k for k in broken if k not in ("name", "run_id"))))
        broken[key] = draw(
            st.one_of(
                st.lists(st.integers(), max_size=2),
                st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
                st.just(math.nan) if key == "world_size" else st.just({"x": 1}),
            )
        )
    return json.dumps(broken).encode()


def test_a_cluster_record_without_nodes(project, state_dir):
    (project / "gpuctl.yaml").write_text("name: fuzz\nstorage:\n  url: ./store\n")
    path = state_dir / "clusters" / "fuzz.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({**valid_cluster("fuzz"), "nodes": []}))
    for command in (["status"], ["down", "--yes"], ["train"], ["ssh", "true"]):
        line = one_error_line(RUNNER.invoke(app, command))
        assert f"{path}: nodes: a cluster has at least one node" in line, command
    assert path.exists()


@FUZZ
@given(data=st.data(), which=st.sampled_from(["cluster", "run", "both"]))
def test_corrupt_state_records(data, which):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config = root / "gpuctl.yaml"
        config.write_text(yaml.safe_dump({"name": "fuzz", "storage": {"url": "./store"}}))
        records = {
            "clusters/fuzz.json": json.dumps(valid_cluster("fuzz")).encode(),
            "runs/20260101-000000-fuzz.json": json.dumps(valid_run("fuzz")).encode(),
        }
        if which in ("cluster", "both"):
            records["clusters/fuzz.json"] = data.draw(corrupt_record(valid_cluster("fuzz")), label="cluster")
        if which in ("run", "both"):
            records["runs/20260101-000000-fuzz.json"] = data.draw(corrupt_record(valid_run("fuzz")), label="run")
        for rel, raw in records.items():
            (root / "state" / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / "state" / rel).write_bytes(raw)
        before = snapshot(root / "state")
        for command in COMMANDS:
            argv = [a.replace("{out}", str(root / "out")) for a in command]
            result = RUNNER.invoke(app, [*argv, "-c", str(config)], env=isolated_env(root))
            assert isinstance(result.exception, (SystemExit, type(None))), (argv, repr(result.exception))
            if result.exit_code != 0:
                line = one_error_line(result)
                assert "state" in line or "provider" in line or "fuzz" in line, line
            assert snapshot(root / "state") == before, argv  # nothing rewritten, nothing deleted

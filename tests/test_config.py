"""Config validation: good files load, bad ones give one clear line and start nothing."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from provision.cli.app import app
from provision.core.config import GpuctlConfig, check_batch, load_config
from provision.core.errors import ConfigError

runner = CliRunner()

BAD_CONFIGS = {
    "bad_yaml": ("train: {seq_len: 12\n", "not valid YAML"),
    "not_mapping": ("- a\n- b\n", "mapping"),
    "unknown_provider": ("provider: {kind: azure}\n", "unknown provider kind"),
    "unknown_top_key": ("trian: {}\n", "trian"),
    "unknown_train_key": ("train: {max_step: 5}\n", "train.max_step"),
    "batch_mismatch": ("train: {train_batch_size: 10}\n", "train_batch_size is 10"),
    "negative_steps": ("train: {max_steps: -5}\n", "train.max_steps"),
    "zero_micro_batch": ("train: {micro_batch: 0}\n", "train.micro_batch"),
    "missing_data": ("train: {data: nope.jsonl}\n", "does not exist"),
    "data_wrong_type": ("train: {data: notes.docx}\n", "is not .txt"),
    "unknown_precision": ("train: {precision: fp8}\n", "train.precision"),
    "zero_stage_4": ("train: {zero_stage: 4}\n", "train.zero_stage"),
    "bad_offload": ("train: {offload_optimizer: nvme}\n", "train.offload_optimizer"),
    "lr_string": ("train: {lr: fast}\n", "train.lr"),
    "bad_storage_scheme": ("storage: {url: 'gs://b/p'}\n", "storage.url"),
    "s3_no_bucket": ("storage: {url: 's3://'}\n", "storage.url"),
    "bad_teardown": ("teardown: sometimes\n", "teardown"),
    "ssh_no_hosts": ("provider: {kind: ssh, hosts: []}\n", "provider.hosts"),
    "ssh_bad_host": ("provider: {kind: ssh, hosts: ['a b@c']}\n", "provider.hosts"),
    "ssh_missing_key": ("provider: {kind: ssh, hosts: [h], identity_file: /no/key}\n", "identity_file"),
    "local_has_hosts": ("provider: {kind: local, hosts: [h]}\n", "provider.hosts"),
    "bad_env_name": ("env: {'1X': y}\n", "env"),
    "bad_name": ("name: Has_Caps\n", "name"),
    "warmup_too_long": ("train: {warmup_steps: 50, max_steps: 10}\n", "warmup_steps"),
    "missing_model_dir": ("train: {model: ./no-such-model}\n", "train.model"),
}


@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
@pytest.mark.parametrize("command", [["up"], ["train"], ["render", "-o", "out"]])
def test_bad_config_one_line_and_nothing_started(project, state_dir, name, command):
    text, expected = BAD_CONFIGS[name]
    (project / "notes.docx").write_text("x")
    (project / "gpuctl.yaml").write_text(text)
    result = runner.invoke(app, command)
    assert result.exit_code != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and "(fix: " in lines[0]
    assert expected in lines[0]
    assert "Traceback" not in result.output + result.stderr
    assert not list(state_dir.glob("clusters/*")) and not list(state_dir.glob("runs/*"))
    assert not (project / "out").exists()


def test_no_config_file(project):
    result = runner.invoke(app, ["up"])
    assert result.exit_code == 2
    assert "gpuctl init" in result.stderr


def test_debug_shows_traceback(project, monkeypatch):
    (project / "gpuctl.yaml").write_text("train: {max_steps: -1}\n")
    monkeypatch.setenv("GPUCTL_DEBUG", "1")
    result = runner.invoke(app, ["render", "-o", "out"])
    assert isinstance(result.exception, ConfigError)


def test_init_writes_every_field_commented(project):
    assert runner.invoke(app, ["init"]).exit_code == 0
    text = (project / "gpuctl.yaml").read_text()
    raw = yaml.safe_load(text)
    cfg = load_config(project / "gpuctl.yaml")
    assert cfg.model_dump(exclude={"base_dir"}) == GpuctlConfig().model_dump(exclude={"base_dir"})
    for section in ("provider", "train", "storage"):
        model = type(getattr(cfg, section))
        assert set(raw[section]) == set(model.model_fields), section
    assert set(raw) == set(GpuctlConfig.model_fields) - {"base_dir"}
    assert text.count("\n#") + text.count("\n  #") >= 25  # commented, not just listed
    again = runner.invoke(app, ["init"])
    assert again.exit_code != 0 and "--force" in again.stderr


def test_batch_arithmetic_names_all_numbers():
    cfg = GpuctlConfig.model_validate({"train": {"micro_batch": 2, "grad_accum": 4, "train_batch_size": 12}})
    assert check_batch(GpuctlConfig().train, 3) == 12
    with pytest.raises(ConfigError) as err:
        check_batch(cfg.train, 3)
    assert all(str(n) in err.value.message for n in (12, 2, 4, 3, 24))


def test_relative_paths_resolve_against_config(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "d.txt").write_text("hello")
    path = tmp_path / "sub" / "gpuctl.yaml"
    path.write_text(
        textwrap.dedent("""
        train: {data: d.txt}
        storage: {url: ./store}
    """)
    )
    cfg = load_config(path)
    assert cfg.data_path() == (tmp_path / "sub" / "d.txt").resolve()
    assert cfg.storage_url() == (tmp_path / "sub" / "store").resolve().as_uri()
    assert Path(cfg.storage_url().removeprefix("file://")).is_absolute()

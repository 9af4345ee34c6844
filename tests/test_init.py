"""`gpuctl init --provider KIND`: a config right for each provider that `plan` says fits and `render` renders;
on a renting provider the target run, teardown after the run by default, and the refusals of `up` and `train`
(the bucket placeholder, a path the rented node would take along, a config plan says does not fit): one line
with the fix, a non-zero exit, nothing rented."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from provision.cli.app import app
from provision.core.config import STORAGE_PLACEHOLDER, GpuctlConfig, load_config
from provision.core.provider_config import IMAGE_CUDA
from provision.flows.init_config import KINDS
from tests.helpers import REPO

pytestmark = pytest.mark.timeout(120)
runner = CliRunner()
RENTING = ("vast", "runpod", "aws")
SECTIONS = ("provider", "train", "storage", "docker", "recovery")


def init(*args: str) -> dict:
    result = runner.invoke(app, ["init", *args])
    assert result.exit_code == 0, result.output
    return yaml.safe_load(Path("gpuctl.yaml").read_text())


def one_error(result) -> str:
    """The single `error: ... (fix: ...)` line of a refused command."""
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code != 0 and len(lines) == 1 and "(fix: " in lines[0], result.output
    assert "Traceback" not in result.output
    return lines[0]


@pytest.mark.parametrize("kind", KINDS)
def test_init_writes_a_config_for_each_provider_that_plan_fits_and_render_renders(project, kind):
    raw = init("--provider", kind)
    text = (project / "gpuctl.yaml").read_text()
    cfg = load_config(project / "gpuctl.yaml")
    assert cfg.provider.kind == kind
    assert set(raw) == set(GpuctlConfig.model_fields) - {"base_dir"}  # every key, none of another kind's
    for section in SECTIONS:
        assert set(raw[section]) == set(type(getattr(cfg, section)).model_fields), (kind, section)
    commented = [line for line in text.splitlines() if line.lstrip().startswith("#")]
    assert len(commented) >= 40, kind
    planned = runner.invoke(app, ["plan", "--json"])
    assert planned.exit_code == 0, planned.output
    assert json.loads(planned.stdout)["fits"] is True, kind
    rendered = runner.invoke(app, ["render", "-o", "bundle"])
    assert rendered.exit_code == 0, rendered.output
    assert (project / "bundle" / "ds_config.json").is_file()


@pytest.mark.parametrize("kind", RENTING)
def test_a_renting_provider_gets_the_target_run(project, kind):
    raw = init("--provider", kind)
    train, prov = raw["train"], raw["provider"]
    gpus = 4 if kind == "aws" else 3
    assert train["model"] == "deepseek-ai/deepseek-llm-7b-base" and train["precision"] == "fp16"
    assert (train["zero_stage"], train["offload_optimizer"]) == (2, "cpu")
    assert (train["micro_batch"], train["grad_accum"], prov["gpus_per_node"]) == (1, 4, gpus)
    assert train["train_batch_size"] == 4 * gpus and train["lr"] == 5e-5
    assert train["seq_len"] == 2048 and train["gradient_checkpointing"] is True  # what plan fits in 24 GB
    assert raw["teardown"] == "after-train" and prov["max_hours"] and prov["max_cost"]
    assert raw["storage"]["url"] == STORAGE_PLACEHOLDER and raw["secrets"] == []
    assert "\n# secrets: [HF_TOKEN]\n" in (project / "gpuctl.yaml").read_text()
    cfg = load_config(project / "gpuctl.yaml")
    assert {"min_ram_gb", "disk_gb"}.isdisjoint(cfg.provider.model_fields_set)  # null: plan's figures


def test_init_refuses_an_existing_file_and_force_overwrites_it(project):
    init("--provider", "vast", "--storage", "s3://my-bucket/gpuctl")
    again = runner.invoke(app, ["init", "--provider", "runpod"])
    assert (
        "--force" in one_error(again)
        and yaml.safe_load((project / "gpuctl.yaml").read_text())["provider"]["kind"] == "vast"
    )
    assert init("--provider", "runpod", "--force")["provider"]["kind"] == "runpod"
    bad = runner.invoke(app, ["init", "--provider", "aws", "--force", "--storage", "gs://bucket/x"])
    assert "storage.url" in one_error(bad)
    assert yaml.safe_load((project / "gpuctl.yaml").read_text())["provider"]["kind"] == "runpod"  # left as it was


def test_teardown_defaults_to_after_train_where_nodes_are_rented():
    for kind in KINDS:
        provider = {"kind": kind, "hosts": ["h"]} if kind == "ssh" else {"kind": kind}
        cfg = GpuctlConfig.model_validate({"provider": provider})
        assert cfg.teardown == ("after-train" if kind in RENTING else "never"), kind
    written = GpuctlConfig.model_validate({"provider": {"kind": "vast"}, "teardown": "never"})
    assert written.teardown == "never"  # only where it is written


def test_the_cuda_filter_is_the_images_cuda():
    """IMAGE_CUDA is derived from the image's pins: the torch build's CUDA and the Dockerfile's base."""
    pin = re.search(r"^# cuda: (\d+\.\d+)$", (REPO / "images" / "requirements-torch-cuda.txt").read_text(), re.M)
    base = re.search(r"^ARG BASE_IMAGE=nvidia/cuda:(\d+\.\d+)\.", (REPO / "Dockerfile").read_text(), re.M)
    assert pin and base and IMAGE_CUDA == pin[1] == base[1]


# --- refusals: nothing is rented ---------------------------------------------------------------------


@pytest.fixture
def vast_api(monkeypatch):
    from tests.fakes.vast_api import FakeVast

    with FakeVast() as fake:
        monkeypatch.setenv("VAST_API_KEY", fake.key)
        yield fake


def vast_config(project: Path, fake, **edit) -> None:
    """`init --provider vast`, then the given keys changed (section.key: value)."""
    init("--provider", "vast", "--force")
    raw = yaml.safe_load((project / "gpuctl.yaml").read_text())
    raw["provider"]["api_url"] = fake.url
    for dotted, value in edit.items():
        section, key = dotted.split("__")
        raw[section][key] = value
    (project / "gpuctl.yaml").write_text(yaml.safe_dump(raw))


def refused_everywhere(*commands: list[str]) -> list[str]:
    return [one_error(runner.invoke(app, command)) for command in commands]


def test_up_and_train_refuse_the_bucket_placeholder(project, vast_api):
    vast_config(project, vast_api)
    for line in refused_everywhere(["up", "--yes"], ["train"]):
        assert STORAGE_PLACEHOLDER in line and "set storage.url" in line
    assert not vast_api.calls  # not even a search


@pytest.mark.parametrize("url", ["./gpuctl-storage", "file:///tmp/ckpt"])
def test_up_and_train_refuse_storage_on_the_rented_node(project, vast_api, url):
    vast_config(project, vast_api, storage__url=url)
    for line in refused_everywhere(["up", "--yes"], ["train"]):
        assert f"storage.url {url} is a path on the rented vast node" in line
        assert "s3://bucket/prefix" in line and "storage.node_local: true" in line
    assert not vast_api.calls
    vast_config(project, vast_api, storage__url=url, storage__node_local=True)
    accepted = runner.invoke(app, ["up", "--dry-run"])  # the user accepts losing them: up goes on
    assert accepted.exit_code == 0, accepted.output
    assert not any(c.method == "PUT" for c in vast_api.calls)


def test_train_and_up_refuse_what_plan_says_does_not_fit(project, vast_api):
    vast_config(
        project,
        vast_api,
        storage__url="s3://my-bucket/gpuctl",
        train__seq_len=4096,
        train__gradient_checkpointing=False,
    )
    closest = ", ".join(json.loads(runner.invoke(app, ["plan", "--json"]).stdout)["closest_changes"])
    for line in refused_everywhere(["up", "--yes"], ["train"]):
        assert "gpuctl plan: deepseek-ai/deepseek-llm-7b-base needs 44.4 GB per GPU" in line
        assert "the RTX 4090 has 24 GB" in line and f"plan's closest config that fits: {closest} (" in line
        assert "gradient_checkpointing=true" in closest and "--force" in line
    assert not vast_api.calls
    forced = runner.invoke(app, ["train", "--force"])  # past plan: on to the next thing train needs
    assert "cluster" in one_error(forced) and "gpuctl plan" not in forced.stderr
    vast_config(project, vast_api, storage__url="s3://my-bucket/gpuctl", provider__min_ram_gb=64)
    for line in refused_everywhere(["up", "--yes"], ["train"]):
        assert "needs 168 GB of host RAM per node, provider.min_ram_gb rents hosts from 64 GB" in line
    assert not vast_api.calls


# --- the offer filters in words ----------------------------------------------------------------------


def test_offers_and_up_say_the_cuda_and_uplink_filters(project, vast_api):
    vast_config(project, vast_api, storage__url="s3://my-bucket/gpuctl")
    listed = runner.invoke(app, ["offers", "--json"])
    assert listed.exit_code == 0, listed.output
    assert [o["id"] for o in json.loads(listed.stdout)] == ["1001", "1003"]  # not 1009 (CUDA 12.4), 1010
    words = f"driver CUDA >= {IMAGE_CUDA} (the trainer image is a CUDA {IMAGE_CUDA} build); host upload >= 430 Mbit/s"
    assert words in listed.stderr and "96.7 GB on node 0" in listed.stderr
    (search,) = [c.body for c in vast_api.calls if c.path == "/api/v0/bundles/"]
    assert search["inet_up"] == {"gte": 430} and search["cuda_max_good"] == {"gte": 12.8}
    dry = runner.invoke(app, ["up", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert words in dry.stderr and "teardown after-train: the vast node deletes itself" in dry.stderr
    table = runner.invoke(app, ["offers"], env={"COLUMNS": "300"})
    assert "cuda_max_good>=12.8" in table.stdout and "inet_up>=430 Mbit/s" in table.stdout


def test_runpod_offers_say_the_filters_the_deploy_carries(project, monkeypatch):
    from tests.fakes.runpod_api import FakeRunPod

    with FakeRunPod() as fake:
        monkeypatch.setenv("RUNPOD_API_KEY", fake.key)
        init("--provider", "runpod", "--storage", "s3://my-bucket/gpuctl")
        raw = yaml.safe_load((project / "gpuctl.yaml").read_text())
        raw["provider"]["api_url"] = fake.url
        (project / "gpuctl.yaml").write_text(yaml.safe_dump(raw))
        table = runner.invoke(app, ["offers"], env={"COLUMNS": "300"})
    assert table.exit_code == 0, table.output
    assert "allowedCudaVersions>=12.8" in table.stdout and "minUpload=430 Mbit/s" in table.stdout
    assert "host upload >= 430 Mbit/s" in table.stderr


def test_a_local_config_turned_to_vast_by_hand_points_at_init(project):
    init("--provider", "local")
    path = project / "gpuctl.yaml"
    path.write_text(path.read_text().replace("  kind: local\n", "  kind: vast\n"))
    line = one_error(runner.invoke(app, ["plan"]))
    assert "provider.gpus_per_node" in line and "`gpuctl init --provider vast FILE` writes a vast config" in line


def test_up_says_when_teardown_never_leaves_the_node_billing(project, vast_api):
    vast_config(project, vast_api, storage__url="s3://my-bucket/gpuctl")
    raw = yaml.safe_load((project / "gpuctl.yaml").read_text())
    (project / "gpuctl.yaml").write_text(yaml.safe_dump({**raw, "teardown": "never"}))
    dry = runner.invoke(app, ["up", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "teardown never (gpuctl.yaml): the vast node bills after the run until `gpuctl down`" in dry.stderr


def test_report_help_names_the_table_not_a_source():
    shown = runner.invoke(app, ["report", "--help"], env={"COLUMNS": "200"})
    assert "The throughput table (mode, batch, tokens/s, memory per GPU, scaling)" in " ".join(shown.stdout.split())
    assert "article" not in shown.stdout

"""The documentation site: it builds with `mkdocs build --strict` (a broken link or a page missing from
the nav fails it), its generated pages are what provision/cli/docs_gen.py writes today, and the gpuctl.yaml
`init` writes carries, over every key, that key's description from the pydantic models: the config
reference, the CLI reference and init's comments have one source each."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
import yaml

from provision.cli import docs_gen
from provision.core import config_doc
from provision.core.config import GpuctlConfig
from provision.flows.init_config import KINDS, config_text
from tests.helpers import REPO

SECTIONS = ("provider", "train", "storage", "docker", "recovery")


def mkdocs_build(root, site) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("mkdocs", reason="the test extra installs mkdocs")
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml"), "-d", str(site)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1", "HOME": str(site.parent)},
    )


def test_the_site_builds_strict(tmp_path):
    built = mkdocs_build(REPO, tmp_path / "site")
    assert built.returncode == 0, built.stderr[-3000:]
    for page in (
        "index.html",
        "first-cloud-run/index.html",
        "reference/config/index.html",
        "troubleshooting/index.html",
    ):
        assert (tmp_path / "site" / page).is_file(), page


def test_a_broken_link_fails_the_build(tmp_path):
    """--strict is what makes a stale link a failure: the same site with one bad link does not build."""
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with open(tmp_path / "docs" / "index.md", "a") as page:
        page.write("\nSee [the gone page](no-such-page.md).\n")
    built = mkdocs_build(tmp_path, tmp_path / "site")
    assert built.returncode != 0 and "no-such-page.md" in built.stderr, built.stderr[-2000:]


def test_the_generated_pages_are_current():
    stale = docs_gen.stale()
    assert stale == [], f"{stale} differ from what the code says: run `{docs_gen.REGENERATE}` and commit them"


def test_every_key_has_a_description():
    models = [GpuctlConfig, *config_doc.PROVIDERS.values(), *config_doc.SECTIONS.values()]
    bare = [
        f"{model.__name__}.{name}"
        for model in models
        for name, field in model.model_fields.items()
        if not field.description and name not in (*SECTIONS, "base_dir")
    ]
    assert bare == [], f"give these fields Field(description=...): {bare}"


def comment_above(text: str, key: str) -> str:
    """The comment lines right above a key's line (a note particular to the file may follow the description)."""
    section, _, name = key.rpartition(".")
    indent = "  " * key.count(".")
    lines = text.splitlines()
    first = lines.index(f"{section}:") if section else 0
    at = next(i for i, line in enumerate(lines) if i > first and line.startswith(f"{indent}{name}:"))
    start = at
    while start > 0 and lines[start - 1].startswith(f"{indent}#"):
        start -= 1
    return "\n".join(lines[start:at]) + "\n"


@pytest.mark.parametrize("kind", KINDS)
def test_init_comments_every_key_with_its_model_description(kind):
    text = config_text(kind)
    raw = yaml.safe_load(text)
    keys = [k for k in raw if k not in SECTIONS] + [f"{s}.{k}" for s in SECTIONS for k in raw[s]]
    missing = [key for key in keys if not comment_above(text, key).startswith(config_doc.doc(kind, key) + "\n")]
    assert missing == [], f"{kind}: these keys are not commented with their description: {missing}"
    assert "README" not in text  # the reference lives in docs/ now


def test_the_config_reference_has_every_key_with_its_default_per_provider():
    page = (REPO / "docs" / "reference" / "config.md").read_text()
    assert "| `provider.gpus_per_node` | integer | `4` | >= 1, <= 16 |" in page  # aws
    assert "| `provider.gpus_per_node` | integer | `3` | >= 1, <= 16 |" in page  # vast, runpod
    assert "| `train.precision` | one of `fp16`, `bf16`, `fp32` | `fp32` |" in page
    for section in SECTIONS[1:]:
        for name in config_doc.SECTIONS[section].model_fields:
            assert f"| `{section}.{name}` |" in page, f"{section}.{name}"


def test_troubleshooting_names_each_error_by_its_first_words_with_its_fix():
    page = (REPO / "docs" / "troubleshooting.md").read_text()
    assert "| storage.url is still the placeholder ... | set storage.url in gpuctl.yaml to your bucket" in page
    assert len(re.findall(r"^\| ", page, re.M)) > 50


def test_the_readme_stays_short_and_its_cloud_example_is_the_guides():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) < 150
    guide = (REPO / "docs" / "first-cloud-run.md").read_text().split("\n## Vast.ai\n", 1)[1]
    example = re.search(r"```bash\n.*?```", readme.split("\n## A cloud run\n", 1)[1], re.S)
    assert example and example[0] in guide, "the README's cloud example must be the guide's Vast.ai block"


@pytest.mark.parametrize(("page", "section"), [("README.md", "\n## Slurm\n"), ("docs/slurm.md", "\n")])
def test_the_slurm_examples_are_valid_configs(page, section):
    text = (REPO / page).read_text().split(section, 1)[1]
    block = re.search(r"```yaml\n(.*?)```", text, re.S)
    assert block, f"{page}: no gpuctl.yaml example"
    cfg = GpuctlConfig.model_validate(yaml.safe_load(block[1]))
    assert cfg.provider.kind == "slurm" and cfg.provider.nodes == 2

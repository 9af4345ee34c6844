"""The house keeps its shape: imports point down (cli -> flows -> providers -> transport ->
estimate -> core) and, within a room, run one way (no two modules import each other), the laptop
side never imports the node side's heavy packages, and the CLI starts without boto3, paramiko,
fabric or torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.import_cycles import cycles, describe, import_graph, mutual_pairs

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["core", "estimate", "transport", "providers", "flows", "cli"]  # lowest first
NODE_ONLY = ("torch", "deepspeed", "transformers")


def provision_modules() -> list[Path]:
    return sorted((ROOT / "provision").rglob("*.py"))


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "provision" or len(parts) < 2 or parts[1] not in LAYERS:
        return None
    return LAYERS.index(parts[1])


def imports_of(path: Path) -> list[tuple[int, str]]:
    """Every module an import statement names, at any depth (function-level imports too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def test_every_module_sits_in_a_room():
    loose = [p.name for p in (ROOT / "provision").glob("*.py") if p.name != "__init__.py"]
    assert loose == [], f"put {loose} in the subpackage of its role"
    rooms = {p.name for p in (ROOT / "provision").iterdir() if p.is_dir() and not p.name.startswith("__")}
    assert rooms - {"templates"} == set(LAYERS)


def test_imports_point_down_only():
    upward = []
    for path in provision_modules():
        rel = path.relative_to(ROOT).with_suffix("")
        own = layer_of(".".join(rel.parts))
        for lineno, module in imports_of(path):
            target = layer_of(module)
            if own is not None and target is not None and target > own:
                upward.append(f"{rel}.py:{lineno} imports {module} ({LAYERS[own]} -> {LAYERS[target]})")
    assert upward == []


def test_laptop_side_never_imports_node_packages_and_trainer_never_imports_provision():
    # `import trainer` alone is fine: render ships the package folder it names (trainer/__init__ is light)
    bad = [
        f"{p.relative_to(ROOT)}:{n} {m}"
        for p in provision_modules()
        for n, m in imports_of(p)
        if m.split(".")[0] in NODE_ONLY or (m.startswith("trainer.") and not m.startswith("trainer.objstore"))
    ]
    bad += [
        f"{p.relative_to(ROOT)}:{n} {m}"
        for p in sorted((ROOT / "trainer").rglob("*.py"))
        for n, m in imports_of(p)
        if m.split(".")[0] == "provision"
    ]
    assert bad == []


def test_the_walker_sees_an_upward_import(tmp_path):
    """The check above can fail: a flows-level import inside a core module is caught."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from provision.flows import job\n")
    assert layer_of(imports_of(probe)[0][1]) == LAYERS.index("flows") > LAYERS.index("core")


ONE_WAY = (
    "let one of them own what both need (move it there, or into a small module both import) so the "
    "import runs one way; `python tests/import_cycles.py` lists every arrow's line"
)


def test_no_two_modules_import_each_other():
    """A lazy (function-level) import counts: it still ties the two modules together. So does one
    under `if TYPE_CHECKING:`: it never runs, but the two still need each other (a type both use
    belongs in a module of its own, or one side names the other's shape by a Protocol); see
    tests/import_cycles.py."""
    graph = import_graph()
    pairs = [describe(graph, a, b) for a, b in mutual_pairs(graph)]
    assert pairs == [], f"these modules import each other: {'; '.join(pairs)}: {ONE_WAY}"


def test_no_import_cycles():
    """Nor around a longer loop (a -> b -> c -> a), in provision/ and trainer/."""
    loops = ["{" + ", ".join(group) + "}" for group in cycles(import_graph())]
    assert loops == [], f"each group imports itself around a loop: {'; '.join(loops)}: {ONE_WAY}"


def test_the_cycle_checks_see_a_cycle(tmp_path):
    """The checks above can fail: a lazy import back is a mutual pair, three modules make a loop,
    a relative import counts, and so does an import under TYPE_CHECKING (only `runtime_only` leaves
    it out, keeping its else)."""
    tree = {
        "provision/__init__.py": "",
        "provision/a.py": "def f():\n    from provision import b\n",
        "provision/b.py": "from provision.a import f\n",
        "provision/c.py": "from . import d\n",
        "provision/d.py": "import provision.e\n",
        "provision/e.py": "from provision.c import x\n",
        "provision/f.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from provision import g\n",
        "provision/g.py": "import typing\nif typing.TYPE_CHECKING:\n    pass\nelse:\n    from provision import h\n",
        "provision/h.py": "def f():\n    from provision.f import x\n",
        "trainer/__init__.py": "",
    }
    for rel, text in tree.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = import_graph(tmp_path)
    assert mutual_pairs(graph) == [("provision.a", "provision.b")]
    assert describe(graph, "provision.a", "provision.b") == "provision.a (line 2) <-> provision.b (line 1)"
    loops = [["provision.c", "provision.d", "provision.e"], ["provision.f", "provision.g", "provision.h"]]
    assert cycles(graph) == [["provision.a", "provision.b"], *loops]
    assert graph["provision.f"] == {"provision.g": 3}  # the type-only arrow closes the loop f -> g -> h -> f
    runs = import_graph(tmp_path, runtime_only=True)
    assert runs["provision.f"] == {} and runs["provision.g"] == {"provision.h": 5}
    assert cycles(runs) == [["provision.a", "provision.b"], loops[0]]


@pytest.mark.parametrize("entry", ["import provision.cli.app", "import provision.cli"])
def test_cli_imports_nothing_heavy(entry):
    heavy = ["torch", "deepspeed", "transformers", "boto3", "botocore", "paramiko", "fabric", "jinja2", "pydantic"]
    code = f"{entry}; import sys; print(','.join(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_help_imports_nothing_heavy():
    code = (
        "import atexit, sys; sys.argv = ['gpuctl', '--help']\nfrom provision.cli.app import main\n"
        "heavy = ('torch', 'boto3', 'paramiko', 'fabric')\n"  # main() leaves through the atexit hooks
        "atexit.register(lambda: print('LOADED:' + ','.join(m for m in heavy if m in sys.modules)))\nmain()"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "LOADED:\n" in out.stdout + "\n" and "Commands" in out.stdout, out.stdout[-500:]


MAX_LINES = 400  # the charter's file size: split a longer module on its natural seam


def test_modules_stay_under_the_size_limit():
    sources = [*provision_modules(), *(ROOT / "trainer").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    long = {str(p.relative_to(ROOT)): n for p in sources if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these modules (over {MAX_LINES} lines): {long}"

"""The walls of docs/ARCHITECTURE.md, checked on the source: who may import what,
module size, and comments that point only inside the repository."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tfcluster"
MODULES = sorted(PACKAGE.rglob("*.py"))
SHIPPED = ("shim.py", "shim_down.py", "shim_facts.py", "shim_fs.py", "shim_net.py", "shim_ports.py",
           "shim_procs.py", "shim_protocol.py", "shim_tasks.py", "shim_up.py", "tfserver.py")


def imports_of(path: Path) -> set[str]:
    """Every tfcluster module `path` imports (relative imports resolved)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = "tfcluster" + (f".{base}" if base else "")
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m.startswith("tfcluster")}


def rel(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


@pytest.mark.parametrize("path", MODULES, ids=rel)
def test_every_module_is_under_400_lines(path):
    assert len(path.read_text().splitlines()) < 400


def test_only_spec_plan_and_cli_read_the_spec():
    allowed = {"tfcluster/plan.py", "tfcluster/cli.py"}
    readers = {rel(p) for p in MODULES
               if any(m == "tfcluster.spec" or m.startswith("tfcluster.spec.") for m in imports_of(p))}
    assert {r for r in readers if not r.startswith("tfcluster/spec/")} <= allowed


def test_transport_knows_no_spec_plan_or_state():
    for path in (PACKAGE / "transport").glob("*.py"):
        bad = {m for m in imports_of(path)
               if m.split(".")[1] in ("spec", "plan", "state", "session", "agent")}
        assert not bad, (rel(path), bad)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_files_import_only_their_siblings(name):
    # relative imports only resolve to the shipped siblings; an installed tfcluster on a
    # host may be another version
    siblings = {f"tfcluster.{Path(s).stem}" for s in SHIPPED}
    modules = {".".join(m.split(".")[:2]) for m in imports_of(PACKAGE / name)}
    assert modules <= siblings | {"tfcluster"}
    assert "from tfcluster" not in (PACKAGE / name).read_text()


def test_comments_point_only_inside_the_repository():
    for path in MODULES:
        text = path.read_text()
        assert "DESIGN.md" not in text and "STYLE.md" not in text, rel(path)


def test_the_engines_launcher_stands_alone():
    # engines/launch.py runs inside TFJob pods and Slurm jobs, where no tfcluster is installed
    assert imports_of(PACKAGE / "engines" / "launch.py") == set()

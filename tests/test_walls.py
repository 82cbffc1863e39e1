"""The walls of docs/ARCHITECTURE.md: import-linter's contracts (pyproject.toml) hold, what runs
where no tfcluster is installed imports only the standard library, and comments point only
inside the repository."""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tfcluster"
HOST = PACKAGE / "host"


def test_import_linter_finds_every_wall_kept():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert lint, "lint-imports is not installed: pip install -e '.[test]'"
    done = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def outside_imports(path: Path) -> set[str]:
    """The top-level names of every absolute import in `path`, lazy ones and `try` fallbacks
    included (relative imports are the file's siblings)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names - {"__future__"}


def test_the_host_files_import_only_the_standard_library_and_each_other():
    """They are shipped flat to hosts whose Python may have nothing else (import-linter
    cannot say 'only the standard library'); tfserver.py alone runs TensorFlow."""
    siblings = {p.stem for p in HOST.glob("*.py")}
    for path in sorted(HOST.rglob("*.py")):
        allowed = set(sys.stdlib_module_names) | siblings | ({"tensorflow"} if path.name == "tfserver.py" else set())
        assert outside_imports(path) <= allowed, (path, outside_imports(path) - allowed)


def test_engines_launch_stands_alone():
    """engines/launch.py runs in TFJob pods and Slurm jobs, where no tfcluster is installed."""
    path = PACKAGE / "engines" / "launch.py"
    tree = ast.parse(path.read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level], "a relative import"
    assert outside_imports(path) <= set(sys.stdlib_module_names), outside_imports(path)


def test_the_launchers_rooms_hold_with_type_hints_too():
    """run -> cluster -> agent (docs/ARCHITECTURE.md), `if TYPE_CHECKING:` imports included:
    import-linter's contract reads the run-time imports only (its switch is global here)."""
    rank = {"agent": 0, "cluster": 1, "run": 2}
    for room, mine in rank.items():
        for path in sorted((PACKAGE / "launch" / room).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
                else:
                    continue
                for name in names:
                    parts = name.split(".")
                    if parts[:2] == ["tfcluster", "launch"] and len(parts) > 2:
                        assert rank.get(parts[2], -1) <= mine, (path, node.lineno, name)


# The programs tfcluster runs, each the one place its process ends: the CLI; on a host, the
# shim and a TF server; in another engine's job, engines/launch.py. bootstrap.py holds the
# text of the program a host runs first (`python -S -c BOOTSTRAP`), not code of this process.
# the probe runs inside a script's own process: it ends one whose script raised, as Python would
# have, without JAX's shutdown barrier (host/probe/sitecustomize.py)
ENTRY_POINTS = {"cli/__init__.py", "host/shim.py", "host/tfserver.py", "host/shim_standby.py", "engines/launch.py",
                "launch/agent/bootstrap.py", "host/probe/sitecustomize.py"}


def _ends_the_process(node: ast.AST) -> bool:
    if isinstance(node, ast.Raise) and node.exc is not None:
        exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        return isinstance(exc, ast.Name) and exc.id == "SystemExit"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        owner = node.func.value
        return (isinstance(owner, ast.Name) and (owner.id, node.func.attr) in
                {("sys", "exit"), ("os", "_exit"), ("os", "abort")})
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("exit", "quit")


def test_only_the_entry_points_end_the_process():
    """Everything else raises a TfclusterError with an exit code, which the CLI's one error
    boundary turns into the exit (docs/ARCHITECTURE.md, "The walls")."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if _ends_the_process(node) and where not in ENTRY_POINTS:
                found.append(f"{where}:{node.lineno}")
    assert not found, found


def test_comments_point_only_inside_the_repository():
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        assert "DESIGN.md" not in text and "STYLE.md" not in text and "../shared" not in text, path

"""The walls of docs/ARCHITECTURE.md: import-linter's contracts (pyproject.toml) hold, and
comments point only inside the repository."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_import_linter_finds_every_wall_kept():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert lint, "lint-imports is not installed: pip install -e '.[test]'"
    done = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_comments_point_only_inside_the_repository():
    for path in sorted((ROOT / "tfcluster").rglob("*.py")):
        text = path.read_text()
        assert "DESIGN.md" not in text and "STYLE.md" not in text and "../shared" not in text, path

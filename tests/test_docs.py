"""The docs a newcomer reads: the user guide builds without a warning (a broken link, an
anchor that is gone, a page left out of the nav all fail `mkdocs build --strict`), and
the README and the architecture page stay short enough to be read."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README_LIMIT = 12_000          # bytes: a first page, not a reference
ARCHITECTURE_LIMIT = 20_000    # bytes: the sides, the walls, the paths; the rest is in the guide
FIRST_COMMANDS = (
    "pip install -e '.[tf]' && tfcluster train sample_clusters/local.yaml",
    "bash scripts/test.sh",
)


def test_the_site_builds_strictly_without_a_warning(tmp_path: Path) -> None:
    # a test dependency: missing, this fails rather than skips, so the docs are always built
    missing = [name for name in ("mkdocs", "material") if importlib.util.find_spec(name) is None]
    assert not missing, "pip install mkdocs mkdocs-material (the docs test builds the site)"
    # not --quiet: it hides the very warnings --strict counts, and the build then passes
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict",
         "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        # the material theme's end-of-life banner is not about these docs
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert not re.search(r"^\W*(WARNING|ERROR)\b", output, re.M), output
    assert (tmp_path / "site" / "index.html").is_file()


def test_readme_and_architecture_stay_short() -> None:
    readme = (ROOT / "README.md").stat().st_size
    architecture = (ROOT / "docs" / "ARCHITECTURE.md").stat().st_size
    assert readme < README_LIMIT, f"README.md is {readme} bytes; move detail into docs/"
    assert architecture < ARCHITECTURE_LIMIT, (
        f"docs/ARCHITECTURE.md is {architecture} bytes; move detail into docs/design/")


def test_readme_opens_with_the_two_commands_for_a_fresh_machine() -> None:
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)
    assert tuple(block.strip() for block in blocks[:2]) == FIRST_COMMANDS

"""A size report, not a limit: tfcluster's modules by lines, largest first, with each package's
total. Length alone says little (docs/ARCHITECTURE.md's walls say what matters); the report
helps to see where a module grew. Usage: python scripts/sizes.py [--top N]"""
from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tfcluster"


def module_lines() -> dict[str, int]:
    """Dotted module name -> its number of lines."""
    return {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts): len(p.read_text().splitlines())
            for p in sorted(PACKAGE.rglob("*.py"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=20, help="how many modules to list (default 20)")
    top = parser.parse_args().top
    sizes = module_lines()
    packages = Counter()
    for name, lines in sizes.items():
        packages[".".join(name.split(".")[:2])] += lines
    print(f"{sum(sizes.values())} lines in {len(sizes)} modules\n\nlargest modules:")
    for name, lines in sorted(sizes.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {lines:6}  {name}")
    print("\nby package:")
    for name, lines in packages.most_common():
        print(f"  {lines:6}  {name}")


if __name__ == "__main__":
    main()

"""The training-script templates shipped in the package (tfcluster.templates).

One script per training mode. A spec names one as `train.script: template:NAME`, and
`tfcluster init MODE` copies one out to start from.
"""
from __future__ import annotations

import importlib.resources
import os
from typing import Any

from tfcluster.errors import UsageError, did_you_mean


def templates_root() -> Any:
    """The package's shipped training scripts (a Traversable); tests swap it out."""
    return importlib.resources.files("tfcluster.templates")


def template_names() -> list[str]:
    """The names `template:NAME` accepts, sorted; [] when the templates are not installed."""
    try:
        return sorted(p.name[:-3] for p in templates_root().iterdir()
                      if p.name.endswith(".py") and not p.name.startswith("_"))
    except (ModuleNotFoundError, OSError):
        return []


def template_path(name: str) -> str:
    """The file of template `name` (one of template_names(); not checked here)."""
    return str(templates_root() / f"{name}.py")


def copy_template(mode: str, dest: str | None) -> str:
    """Copy the template for `mode` to `dest` (default train_<mode>.py); returns the path written."""
    modes = [name.replace("_", "-") for name in template_names()]   # one template per mode
    if mode not in modes:
        # the template's file name given for its mode (between_graph), or a typo of one
        raise UsageError(f"unknown mode {mode!r}" + (did_you_mean(mode.replace("_", "-"), modes)
                                                     or f"; choose one of: {', '.join(modes)}"))
    name = mode.replace("-", "_") + ".py"
    if dest and dest.endswith(("/", os.sep)) and not os.path.lexists(dest):
        try:       # `newdir/`: a directory meant, so made (its parent must be there)
            os.mkdir(dest)
        except OSError as e:
            raise UsageError(f"cannot make directory {dest}: {e.strerror}") from None
    if dest and os.path.isdir(dest) and not os.path.islink(dest):
        dest = os.path.join(dest, f"train_{name}")       # a directory: the default name in it
    dest = dest or f"train_{name}"
    data = templates_root().joinpath(name).read_bytes()
    # O_EXCL: never over an existing file, and (with O_NOFOLLOW) never through a link,
    # dangling or not
    try:
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except FileExistsError:
        raise UsageError(f"{dest} already exists; pass another destination") from None
    except FileNotFoundError:
        where = os.path.dirname(dest)
        raise UsageError(f"cannot write {dest}: " + (f"no directory {where}" if where and not os.path.isdir(where)
                                                     else "No such file or directory")) from None
    except OSError as e:
        raise UsageError(f"cannot write {dest}: {e.strerror}") from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return dest

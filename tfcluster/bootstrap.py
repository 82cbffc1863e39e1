"""What tfcluster ships to a host, and the program that checks it is there.

The shim and the TF server are plain files copied to `<cluster_dir>/bin/` once per
content change. The bootstrap runs with `python -c` before they are known to be
there: it answers which files are stale and, when none is, the next request too,
so a warm host costs one remote execution.
"""
from __future__ import annotations

import functools
from pathlib import Path

SHIPPED = ("shim.py", "shim_ports.py", "shim_procs.py", "shim_protocol.py", "shim_tasks.py", "tfserver.py",
           "probe/sitecustomize.py")
PACKAGE_DIR = str(Path(__file__).parent)
MIN_PYTHON = (3, 8)

# Runs with `python -c` before the shim is known to be there: says which shipped files
# are stale and, when none is, answers the `batch` on the next line in the same exec.
BOOTSTRAP = r"""
import hashlib, json, os, runpy, sys
if sys.version_info < %r:
    print(json.dumps({"error": "python %%d.%%d is too old (tfcluster needs >= 3.8)" %% sys.version_info[:2]}))
    sys.exit(3)
req = json.loads(sys.stdin.buffer.readline())  # the binary reader: the shim reads line 2 from it
bindir = os.path.expanduser(req["bindir"])
stale = []
for name, digest in sorted(req["files"].items()):
    try:
        with open(os.path.join(bindir, name), "rb") as f:
            fresh = hashlib.sha256(f.read()).hexdigest() == digest
    except OSError:
        fresh = False
    if not fresh:
        stale.append(name)
print(json.dumps({"stale": stale, "bindir": bindir}), flush=True)
if not stale:
    sys.path.insert(0, bindir)
    sys.argv = [os.path.join(bindir, "shim.py"), "batch"]
    runpy.run_path(sys.argv[0], run_name="__main__")
""" % (MIN_PYTHON,)



@functools.lru_cache(maxsize=None)
def shipped() -> dict[str, bytes]:
    """name -> content of every file the host needs."""
    return {name: (Path(PACKAGE_DIR) / name).read_bytes() for name in SHIPPED}

"""What tfcluster ships to a host, and the program that checks it is there.

The shim and the TF server are plain files copied to `<cluster_dir>/bin/` once per
content change. The bootstrap runs with `python -c` before they are known to be
there: it makes the cluster tree private (shim_fs.py, which it carries inline),
answers which files are stale and, when none is, the next request too, from the very
bytes it hashed, so a warm host costs one remote execution. docs/ARCHITECTURE.md,
"Files and directories on a host".
"""
from __future__ import annotations

import functools
from pathlib import Path

from tfcluster.host import HOST_DIR

SHIPPED = ("shim.py", "shim_down.py", "shim_facts.py", "shim_fs.py", "shim_net.py", "shim_ports.py",
           "shim_procs.py", "shim_protocol.py", "shim_tasks.py", "shim_up.py", "tfserver.py", "probe/sitecustomize.py")
# Every shim runs without `site` (`python -S`): .pth files and sitecustomize are a third to a
# half of a remote execution's CPU, for nothing the shim imports (docs/ARCHITECTURE.md,
# "Files and directories on a host"). shim_facts.site_path() finds what `site` would add.
NO_SITE = "-S"
MIN_PYTHON = (3, 8)

# After shim_fs.py's definitions: refuse an old Python, make the tree private, say which
# shipped files are stale and, when none is, run the shim's command (`batch`, or `up`) on the next
# request line from the bytes just hashed (the shim's siblings too: a finder serves them).
_MAIN = r"""
import json, sys
if sys.version_info < %r:
    print(json.dumps({"error": "%%s is python %%d.%%d; tfcluster needs >= 3.8" %% ((sys.executable,) + tuple(sys.version_info[:2]))}))
    sys.exit(3)
req = json.loads(sys.stdin.buffer.readline())  # the binary reader: the shim reads line 2 from it
try:
    private_tree(req.get("dirs", ()))
except (Refused, OSError) as e:
    print(json.dumps({"error": str(e) if isinstance(e, Refused) else "%%s: %%s" %% (type(e).__name__, e)}))
    sys.exit(3)
bindir = expand(req["bindir"])
blobs, stale = {}, []
for name, digest in sorted(req["files"].items()):
    data = read_file(os.path.join(bindir, name))
    if data is not None and hashlib.sha256(data).hexdigest() == digest:
        blobs[name] = data
    else:
        stale.append(name)
print(json.dumps({"stale": stale, "bindir": bindir}), flush=True)
if not stale:
    import importlib.util
    import marshal

    # The compiled module, from bindir's cache of compiled code when it is that source's
    # (the key: the source's sha256 and this interpreter's bytecode magic), else compiled
    # and cached. Only in a bindir made private above: only this user could have written it.
    cache = bindir in [expand(d) for d in req.get("dirs", ())]

    def code_of(name):
        key = "%%s.%%s" %% (req["files"][name][:32], importlib.util.MAGIC_NUMBER.hex())
        path = os.path.join(bindir, ".%%s.%%s.code" %% (name.replace("/", "_"), key))
        data = read_file(path) if cache else None
        if data is not None:
            try:
                return marshal.loads(data)
            except Exception:
                pass
        code = compile(blobs[name], os.path.join(bindir, name), "exec")
        try:
            if cache:
                write_new(path, marshal.dumps(code))
        except OSError:
            pass
        return code

    class Hashed:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if path is None and name + ".py" in blobs:
                return importlib.util.spec_from_loader(name, Hashed, origin=os.path.join(bindir, name + ".py"))
            return None

        @staticmethod
        def create_module(spec):
            return None

        @staticmethod
        def exec_module(module):
            module.__file__ = module.__spec__.origin
            exec(code_of(module.__name__ + ".py"), module.__dict__)

    sys.meta_path.insert(0, Hashed)
    sys.argv = [os.path.join(bindir, "shim.py"), req.get("command", "batch")]
    shim = {"__name__": "__main__", "__file__": sys.argv[0], "__package__": None,
            "__builtins__": __builtins__}
    exec(code_of("shim.py"), shim)
""" % (MIN_PYTHON,)

BOOTSTRAP = (Path(HOST_DIR) / "shim_fs.py").read_text() + _MAIN


def bootstrap_argv(python: str) -> list[str]:
    """The bootstrap's command line on a host (its request comes on stdin)."""
    return [python, NO_SITE, "-c", BOOTSTRAP]


def cluster_tree(paths, bindir: str) -> list[str]:
    """Every directory of the cluster tree (a names.ClusterPaths), parents first: made
    private before anything is written into it. `bindir` is left out when it is not the
    cluster's own (a local host running the shim from the package)."""
    dirs = [paths.root, paths.cache, paths.piddir, paths.runs]
    if bindir == paths.bindir:
        subdirs = sorted({name.rpartition("/")[0] for name in SHIPPED if "/" in name})
        dirs[1:1] = [paths.bindir] + [f"{paths.bindir}/{d}" for d in subdirs]
    return dirs


@functools.lru_cache(maxsize=None)
def shipped() -> dict[str, bytes]:
    """name -> content of every file the host needs."""
    return {name: (Path(HOST_DIR) / name).read_bytes() for name in SHIPPED}

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
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from tfcluster.errors import PreflightError
from tfcluster.host import HOST_DIR, shim_fs
from tfcluster.host import shim_protocol as proto
from tfcluster.launch.agent.lines import checked, json_object, tail_text

SHIPPED = ("shim.py", "shim_cgroup.py", "shim_ckpt.py", "shim_facts.py", "shim_fence.py", "shim_fs.py", "shim_launch.py", "shim_net.py", "shim_notice.py",
           "shim_ports.py", "shim_procs.py", "shim_protocol.py", "shim_rules.py", "shim_talk.py", "shim_tasks.py", "shim_standby.py", "shim_warm.py",
           "tfserver.py", "probe/sitecustomize.py")
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

# Before any import: `python -c` puts the current directory first on sys.path (as '', and a
# relative PYTHONPATH entry is relative to it too), so a `json.py` someone else left where
# tfcluster was started would run as this user. Only absolute entries stay. Not `-I`: it would
# also drop PYTHONPATH and the user's site-packages, which the tasks do see, from what `info`
# answers (docs/security.md, "Files tfcluster reads, writes and runs").
_ABSOLUTE_PATH_ONLY = 'import sys\nsys.path[:] = [p for p in sys.path if p.startswith("/")]\n'

BOOTSTRAP = _ABSOLUTE_PATH_ONLY + (Path(HOST_DIR) / "shim_fs.py").read_text() + _MAIN


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


class ShimPlace:
    """Where one host's shim lives and how it gets there (HostAgent's, and only its): the
    bootstrap's request and verdict, stale files shipped, the shim's command line."""

    def __init__(self, host: str, transport, python: str, paths, bindir: str) -> None:
        self.host, self.transport, self.python, self.paths = host, transport, python, paths
        self.wanted = bindir             # as the plan wrote it (`~/` is expanded there)
        self.bindir: str | None = None   # absolute, once the bootstrap said (or in-process)

    def request(self, command: str) -> tuple[dict, dict[str, bytes]]:
        """Connect; the bootstrap's request line (it then runs the shim's `command`) and
        the shipped files by name."""
        self.transport.connect()
        files = shipped()
        return {"bindir": self.wanted, "dirs": cluster_tree(self.paths, self.wanted),
                "files": {n: hashlib.sha256(d).hexdigest() for n, d in files.items()},
                "command": command}, files

    def verdict(self, rc: int | None, first: dict | None, stderr: bytes) -> list[str]:
        """The stale files the bootstrap's first answer names, or the PreflightError that
        says why there is none. `rc`: None while the bootstrap still runs."""
        if rc == 127 or (rc and b"not found" in stderr):
            raise PreflightError(f"host {self.host}: {self.python} not found",
                                 hint="set `python:` in the spec to an interpreter that has tensorflow")
        if first is not None:            # its error: too old, or the tree is not private
            checked(first, f"host {self.host}", PreflightError)
        if rc or first is None:
            raise PreflightError(f"host {self.host}: {self.python}: {tail_text(stderr) or f'exit status {rc}'}")
        self.bindir = first["bindir"]
        return first["stale"]

    def verdict_of(self, lines) -> list[str]:
        """verdict() on a running bootstrap's Lines (its exit and stderr: when it said nothing)."""
        first = lines.next()
        if first is not None:
            return self.verdict(None, first, b"")
        rc = lines.proc.wait(10.0)
        return self.verdict(1 if rc is None else rc, None, lines.proc.read_stderr())

    def ship(self, stale: list[str], files: dict[str, bytes]) -> None:
        self.transport.put_many([(files[name], f"{self.bindir}/{name}", 0o700) for name in stale])

    def here(self) -> None:
        """In-process: the cluster tree made private here, the shim run from the package."""
        try:
            shim_fs.private_tree(cluster_tree(self.paths, self.wanted))
        except (shim_fs.Refused, OSError) as e:
            raise PreflightError(f"host {self.host}: {proto.describe_exception(e)}") from None
        self.bindir = self.wanted

    def argv(self, command: str) -> list[str]:
        return [self.python, NO_SITE, f"{self.bindir}/shim.py", command]

    def open(self, spawn, command: str, data: bytes, in_process: bool):
        """The shim's `command` on its request `data` as a running process, through the
        bootstrap (in-process: from the package, the tree made private here); stale files
        are shipped and the command runs again by path. `spawn(argv, data)` starts one
        process and returns its Lines, positioned after the bootstrap's verdict."""
        if in_process:
            self.here()
            return spawn(self.argv(command), data)
        boot, files = self.request(command)
        lines = spawn(bootstrap_argv(self.python), proto.json_line(boot) + data)
        stale = self.verdict_of(lines)
        if stale:
            lines.proc.wait(10.0)
            self.ship(stale, files)
            lines = spawn(self.argv(command), data)
        return lines

    def run(self, commands: dict, timeout: float) -> dict | None:
        """The bootstrap as one run answering a batch of `commands`: their answers, or None
        when it found stale files (shipped now: ask again by path)."""
        request, files = self.request(proto.BATCH)
        result = self.transport.run(bootstrap_argv(self.python),
                                    proto.json_line(request) + proto.json_line({"commands": commands}),
                                    timeout=timeout)
        lines = [x for x in map(json_object, result.stdout.splitlines()) if x is not None]
        stale = self.verdict(result.rc, lines[0] if lines else None, result.stderr)
        if not stale and len(lines) > 1 and "answers" in lines[1]:
            return lines[1]["answers"]
        self.ship(stale, files)
        return None


def call_here(command: str, request: dict, cancelled: Callable[[], bool] = lambda: False):
    """A one-shot shim command answered in this process (shim_protocol.IN_PROCESS), its
    request copied as if it had travelled as JSON. A fence it installed goes again when
    `cancelled()` says, once it is done, that nobody will take the answer (Ctrl-C landed
    meanwhile: a remote shim sees its launcher gone the same way, shim.main)."""
    from tfcluster.host import shim
    try:
        return shim.COMMANDS[command](json.loads(json.dumps(request)))
    except (proto.ShimError, OSError, KeyError, ValueError) as e:
        return proto.error_answer(proto.describe_exception(e))
    finally:
        if cancelled():
            shim.take_back(shim.installs_of(command, request))

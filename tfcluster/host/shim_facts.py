"""The host's facts for `info`: Python, TensorFlow, TensorBoard, Keras, tf_keras, jax and
jaxlib versions, TF's CUDA build, GPUs, machine id; and the site directories the shim runs without.

Shipped beside shim.py (standard library only, Python >= 3.8). The shim runs under
`python -S` (bootstrap.NO_SITE): site_path() finds the directories `site` would add,
without running its .pth files, and full_site() runs `site` when TensorFlow is not found
there. docs/ARCHITECTURE.md, "Files and directories on a host".
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

TF_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tf-nightly",
                    "tf-nightly-cpu", "tf-nightly-gpu", "tensorflow-intel", "tensorflow-macos")
TB_DISTRIBUTIONS = ("tensorboard", "tb-nightly")
# Which Keras `tf.keras` is: Keras 3 from TF 2.16 on, tf_keras (Keras 2) with
# TF_USE_LEGACY_KERAS=1 (docs/modes.md, "Keras"). Read from their metadata, never imported.
KERAS_DISTRIBUTIONS = ("keras", "keras-nightly")
TF_KERAS_DISTRIBUTIONS = ("tf-keras", "tf-keras-nightly")
# Mode keras-jax needs the same jax and jaxlib on every host (docs/modes.md, "Mode keras-jax"); read
# from their metadata too: importing jax takes a second and may grab a GPU.
JAX_DISTRIBUTIONS = ("jax",)
JAXLIB_DISTRIBUTIONS = ("jaxlib",)
# jax runs on NVIDIA GPUs only with its CUDA plugin (`pip install "jax[cuda12]"`); without it, it
# falls back to the CPU with a warning, and its processes there hold other devices than the rest.
JAX_CUDA_DISTRIBUTIONS = ("jax-cuda12-plugin", "jax-cuda13-plugin")


def tf_version() -> str | None:
    version = installed_version(TF_DISTRIBUTIONS)
    if version is None and full_site():   # installed where only a .pth file says
        version = installed_version(TF_DISTRIBUTIONS)
    return version


def site_path() -> list:
    """sys.path with the directories `site` adds: the shim runs under `python -S`
    (bootstrap.NO_SITE). The user's (where `site` would enable it), a venv's site-packages,
    then the system's, as `site` orders them; no .pth file is run (full_site() does that)."""
    if _SITE or not _ours_alone():
        return sys.path
    _SITE.append(None)          # computed once, also when it adds nothing
    import site
    exe_dir = os.path.dirname(os.path.abspath(sys.executable))
    prefixes, user, own = [sys.prefix, sys.exec_prefix], True, []
    for folder in (exe_dir, os.path.dirname(exe_dir)):
        conf = _venv_conf(os.path.join(folder, "pyvenv.cfg"))
        if conf is not None:
            system = conf.get("include-system-site-packages", "").lower() == "true"
            own, user = _venv_site_packages(os.path.dirname(exe_dir)), system
            prefixes = prefixes if system else []
            break
    dirs = ([site.getusersitepackages()] if user and site.check_enableusersite() else [])
    dirs += own + (site.getsitepackages(prefixes) if prefixes else [])
    sys.path.extend(d for d in dirs if d not in sys.path and os.path.isdir(d))   # searched only
    return sys.path


def _venv_site_packages(venv: str) -> list:
    """A venv's own site directories, as `site` lists them once it has read pyvenv.cfg. Not
    site.getsitepackages([venv]): Debian's and Ubuntu's Python answer it by whether `site`
    already made sys.prefix a venv's, which under -S it has not, with dist-packages
    directories no venv has."""
    version = "python%d.%d" % sys.version_info[:2]
    libdirs = [getattr(sys, "platlibdir", "lib")]
    libdirs += ["lib"] if libdirs[0] != "lib" else []
    return [os.path.join(venv, libdir, version, "site-packages") for libdir in libdirs]


def _ours_alone() -> bool:
    """Running under -S, and that -S is bootstrap.NO_SITE alone. A `python:` that is a
    wrapper adding its own -S runs every task without `site` too: `info` answers for what
    the tasks will see, so then the site directories stay out. (Python < 3.10 has no
    sys.orig_argv: the -S is taken as ours.)"""
    if not sys.flags.no_site:
        return False
    argv = list(getattr(sys, "orig_argv", None) or [])[1:]
    seen, i = 0, 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] not in ("-", "-c", "-m"):
        flag = argv[i]
        if flag in ("-X", "-W"):
            i += 1                                  # its value follows
        elif not flag.startswith(("--", "-X", "-W")):
            seen += flag.count("S")
        i += 1
    return seen <= 1


def _venv_conf(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            pairs = (line.partition("=") for line in f)
            return {k.strip().lower(): v.strip() for k, sep, v in pairs if sep}
    except OSError:
        return None


def full_site() -> bool:
    """Run `site` as Python would have (its .pth files too), once; False when it ran."""
    if _FULL_SITE or not _ours_alone():
        return False
    _FULL_SITE.append(True)
    import site
    site.main()
    return True


_SITE: list = []
_FULL_SITE: list = []


def installed_version(distributions) -> str | None:
    """The version of the first of these distributions installed here, else None."""
    return installed_versions(distributions)[0]


def installed_versions(*groups, fallback: bool = True) -> list:
    """For each group of distributions, the version of its first one installed here, else
    None; sys.path is listed once for all of them.

    The `*.dist-info` folders on sys.path first (what importlib.metadata finds, in its
    order, without its imports and scans: a third of a remote execution's CPU); then, with
    `fallback`, importlib.metadata itself, for other kinds of installs. Without it a group
    that is absent costs nothing more: for a wheel-only package usually absent (tf_keras),
    whose every miss would otherwise pay importlib.metadata's ~30 ms."""
    found = _dist_infos(site_path(), {_normalized(d) for group in groups for d in group})
    return [_first(found, group, fallback) for group in groups]


def _first(found: dict, distributions, fallback: bool) -> str | None:
    for dist in distributions:
        version = found.get(_normalized(dist))
        if version:
            return version
    if not fallback:
        return None
    try:
        from importlib import metadata
    except ImportError:  # pragma: no cover - Python < 3.8
        return None
    for dist in distributions:
        try:
            return metadata.version(dist)
        except Exception:
            continue
    return None


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _dist_infos(path, wanted=None) -> dict:
    """normalized distribution name -> the Version of its first dist-info on `path`; only
    the `wanted` names' METADATA is read (a TF environment has hundreds of others)."""
    found = {}
    for entry in path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            if not name.endswith(".dist-info"):
                continue
            key = _normalized(name[:-len(".dist-info")].partition("-")[0])
            if key in found or (wanted is not None and key not in wanted):
                continue
            try:
                with open(os.path.join(entry or ".", name, "METADATA"), "rb") as f:
                    head = f.read(4096)
            except OSError:
                continue
            match = re.search(rb"^Version: *(\S+)", head, re.M)
            if match:
                found[key] = match.group(1).decode("ascii", "replace")
    return found


def tf_build() -> dict:
    """The CUDA and cuDNN versions TensorFlow was built with (None for a CPU build, or
    when unknown), read from its build_info.py as text: importing TF costs seconds."""
    found = {"cuda_version": None, "cudnn_version": None}
    try:
        import importlib.util
        site_path()
        spec = importlib.util.find_spec("tensorflow")  # locates, runs nothing
        for folder in (spec.submodule_search_locations or []) if spec else []:
            path = os.path.join(folder, "python", "platform", "build_info.py")
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    info = _build_info(f.read())
                for key in found:
                    found[key] = str(info[key]) if info.get(key) else None
                break
    except Exception:  # a broken install is reported by the TF-missing check, not here
        pass
    return found


def _build_info(source: bytes) -> dict:
    """`build_info = {...}` or `collections.OrderedDict([(k, v), ...])`, never executed."""
    import ast
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "build_info"
                                                for t in node.targets):
            value = node.value
            if isinstance(value, ast.Call) and value.args:
                value = value.args[0]
            return dict(ast.literal_eval(value))
    return {}


def nvidia() -> tuple[int, str | None]:
    """(GPU count, driver version or None) from one nvidia-smi call: it answers a line per GPU."""
    try:
        if not _on_path("nvidia-smi"):
            raise FileNotFoundError("nvidia-smi")      # no fork for a command that is not there
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=20)
        words = out.stdout.decode(errors="replace").split() if out.returncode == 0 else []
        drivers = [w for w in words if w[:1].isdigit()]
        if drivers:
            return len(drivers), drivers[0]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus")), None
    except OSError:
        return 0, None


def _on_path(command: str) -> bool:
    return any(os.access(os.path.join(d or ".", command), os.X_OK)
               for d in os.environ.get("PATH", os.defpath).split(os.pathsep))


def machine_id() -> str:
    """What tells two hosts of a spec apart as machines whose ports and processes are their
    own: the machine id, the boot id (hosts cloned from one image share a machine id, not a
    boot) and the network namespace (one kernel's namespaces each have their own ports). Two
    names of one machine give the same; "" when none can be read."""
    machine = machine_file()
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return "%s:%s:%d" % (machine, boot, net_namespace()) if machine or boot else ""


def machine_file() -> str:
    """The machine id systemd or D-Bus wrote ("" where neither did)."""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            continue
    return ""


def net_namespace() -> int:
    """This process's network namespace (its inode; 0 where /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return 0


def hostname_address() -> list:
    """[hostname, the address it resolves to here, or None]. JAX's CPU collectives (gloo) tell
    the other processes this address to connect back to; a hostname that resolves to loopback
    (Debian's 127.0.1.1, a cloud image's 127.0.0.1) cannot be reached from another machine."""
    name = socket.gethostname()
    try:
        return [name, socket.gethostbyname(name)]
    except OSError:
        return [name, None]

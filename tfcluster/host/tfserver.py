"""The TensorFlow server tfcluster runs for each ps/worker task.

Shipped to the hosts beside shim.py and started by it. Reads TF_CONFIG, starts a
gRPC server for its task (a warm start, `up`'s, first waits for GO on stdin), says where
it listens, then serves until killed (TF servers never exit on their own). Standard
library + tensorflow only.

The server needs TensorFlow's runtime (its shared libraries: kernels, devices, gRPC), not
its Python API: it imports `tensorflow.python.training.server_lib` without running
`tensorflow/__init__.py` (0.5 s instead of 4-5 s of CPU, and a fraction of the memory).
Where that cannot be exact (a TensorFlow plugin directory whose libraries the package's
`__init__` would load) or fails, it is the full `import tensorflow`; TFCLUSTER_SERVER_IMPORT
=full asks for that always. See docs/design/remote-execs.md, "The servers' import".
"""
from __future__ import annotations

import importlib.util
import json
import os
import site
import sys
import types

IMPORT_VAR = "TFCLUSTER_SERVER_IMPORT"   # "lean" (the default) or "full"


def plugin_dirs(spec=None) -> list[str]:
    """Libraries `tensorflow/__init__.py` would load and the lean import would not:
    pluggable devices and kernels in `tensorflow-plugins` beside any site directory, and
    custom kernels in `tensorflow/core/kernels`. `spec`: tensorflow's, when found already."""
    spec = spec or importlib.util.find_spec("tensorflow")
    if spec is None or not spec.submodule_search_locations:
        return []
    here = list(spec.submodule_search_locations)
    sites = set(sys.path) | {os.path.dirname(d) for d in here}
    try:
        sites.update(site.getsitepackages())
        sites.add(site.getusersitepackages())
    except AttributeError:               # a virtualenv's old site.py
        pass
    found = [os.path.join(d, "tensorflow-plugins") for d in sites if d]
    found += [os.path.join(d, "core", "kernels") for d in here]
    return sorted(d for d in found if os.path.isdir(d) and os.listdir(d))


def lean_server_lib(spec):
    """tensorflow.python.training.server_lib under a bare `tensorflow` package (`spec`:
    tensorflow's)."""
    package = types.ModuleType("tensorflow")
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    sys.modules["tensorflow"] = package
    from tensorflow.python.training import server_lib
    return server_lib.Server, server_lib.ClusterSpec


def server_classes():
    """(Server, ClusterSpec): lean where that is exact, else from `import tensorflow`. A
    failed lean import leaves half-registered extension modules behind, so the fallback is
    this program again, full (the same pid: the shim's records stay true)."""
    lean = os.environ.get(IMPORT_VAR, "lean") != "full"
    spec = importlib.util.find_spec("tensorflow") if lean else None
    if spec is not None and not plugin_dirs(spec):
        try:
            return lean_server_lib(spec)
        except Exception as e:  # noqa: BLE001 - any failure of the shortcut: the full import
            print(f"tfcluster: lean TensorFlow import failed ({type(e).__name__}: {e}); "
                  f"importing all of tensorflow", file=sys.stderr, flush=True)
            os.environ[IMPORT_VAR] = "full"
            sys.stdout.flush()
            os.execv(sys.executable, [sys.executable, *sys.argv])
    import tensorflow as tf
    return tf.distribute.Server, tf.train.ClusterSpec


def task_of(text: str) -> tuple[dict, str, int, str]:
    """(cluster, job, index, address) from a TF_CONFIG's text; raises on a bad one."""
    config = json.loads(text)
    cluster, task = config["cluster"], config["task"]
    job, index = task["type"], int(task["index"])
    return cluster, job, index, cluster[job][index]


def main() -> int:
    try:
        cluster, job, index, address = task_of(os.environ["TF_CONFIG"])
    except (KeyError, ValueError, IndexError, TypeError) as e:
        print(f"tfcluster: bad TF_CONFIG: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 2
    Server, ClusterSpec = server_classes()   # only after the config proved usable

    if os.environ.pop("TFCLUSTER_HOLD", None) == "1":   # shim_protocol.HOLD_VAR: a warm start
        # `up` starts the import while its checks run; the port is bound only on GO. Anything
        # else (EOF: the checks failed, the launcher went away) ends the process unbound. GO
        # may carry the TF_CONFIG to serve (shim_protocol.GO_WITH): a server held before its
        # cluster was known, for the same task.
        line = sys.stdin.readline()
        if line.startswith("GO ") and line.strip() != "GO":
            try:
                cluster, given_job, given_index, address = task_of(line[3:])
            except (KeyError, ValueError, IndexError, TypeError) as e:
                print(f"tfcluster: bad TF_CONFIG at GO: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                return 2
            if (given_job, given_index) != (job, index):
                print(f"tfcluster: GO names {given_job}:{given_index}, this server is {job}:{index}",
                      file=sys.stderr, flush=True)
                return 2
            os.environ["TF_CONFIG"] = line[3:].strip()
        elif line != "GO\n":
            return 0
    server = Server(ClusterSpec(cluster), job_name=job, task_index=index, protocol="grpc", start=True)
    print(f"tfcluster: server {job}:{index} listening on {address}", flush=True)
    server.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())

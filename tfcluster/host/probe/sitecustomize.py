"""tfcluster's start-up probe for a training script (docs/design/diagnoses.md, "Diagnoses").

tfcluster puts this directory first on a script's PYTHONPATH, so Python runs this file
at start-up as `sitecustomize`. It imports nothing heavy and changes nothing until the
script itself imports TensorFlow's session module; then it wraps `BaseSession.__init__`
so that the first session created with global variables in its graph prints one line

    tfcluster-placement: {"task": "worker:1", "vars": [[name, device, shape, dtype], ...]}

to stderr (the task's log), which the launcher compares across workers. It also reports
when `SessionManager` finds the model not ready (variables not initialised), a wait that
TensorFlow logs only at INFO level. In a TF2 mode (a TF_CONFIG, no TF1 probe asked for) it
reports the strategy the script builds, `tfcluster-strategy: {"task", "class", "replicas"}`,
which the launcher compares with the mode (diagnose/strategy.py). Around a Keras `evaluate` or
`predict` it writes `tfcluster-keras: evaluate` and `tfcluster-keras: evaluate done`: their
bars are no steps of a fit (watch/metrics.py).

With TFCLUSTER_STDOUT_FLUSH=<seconds> (tfcluster's default for scripts: 0.01) it makes the
script's stdout block-buffered with a thread that flushes it that often, instead of the
one `write` per line that PYTHONUNBUFFERED costs: lines reach the log within that time,
and a Python write to stderr (warnings, logging, a traceback) flushes stdout first. Any `sitecustomize` the user has runs afterwards,
exactly as it would have; this directory is taken back off PYTHONPATH so the script's
own child processes are not probed.
"""
import importlib.machinery
import io
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_MARK = "tfcluster-placement: "
_WAIT_MARK = "tfcluster-not-ready: "
_MAX_VARS = 20000
_reported = []


def _emit(text):
    try:
        os.write(2, (text + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


def _report(session):
    if _reported:
        return
    graph = getattr(session, "graph", None)
    if graph is None:
        return
    variables = graph.get_collection("variables")
    if not variables:
        return
    _reported.append(True)
    rows = []
    for v in variables[:_MAX_VARS]:
        try:
            shape = v.shape.as_list() if v.shape.rank is not None else None
        except (AttributeError, ValueError):
            shape = None
        dtype = getattr(getattr(v, "dtype", None), "base_dtype", None)
        rows.append([v.name, v.device or "", shape, getattr(dtype, "name", str(dtype))])
    task = "%s:%s" % (os.environ.get("TFCLUSTER_JOB", "?"), os.environ.get("TFCLUSTER_TASK_INDEX", "?"))
    import json  # here, not at start-up: 2 ms of every script's start (and every restart's)
    _emit(_MARK + json.dumps({"task": task, "pid": os.getpid(), "vars": rows,
                              "truncated": len(variables) > _MAX_VARS}, separators=(",", ":")))


def _after_init(cls, then):
    """cls.__init__ runs `then(self)` after itself, once patched; `then` failing is swallowed."""
    original = getattr(cls, "__init__", None) if cls is not None else None
    if original is None or getattr(original, "_tfcluster", False):
        return

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)  # tfcluster's start-up probe: your call, unchanged
        try:
            then(self)
        except Exception:  # noqa: BLE001 - the probe must never break the user's script
            pass

    __init__._tfcluster = True
    cls.__init__ = __init__


def _patch_session(module):
    _after_init(getattr(module, "BaseSession", None), _report)


def _patch_session_manager(module):
    cls = getattr(module, "SessionManager", None)
    original = getattr(cls, "_model_not_ready", None)
    if original is None or getattr(original, "_tfcluster", False):
        return

    def _model_not_ready(self, sess):
        why = original(self, sess)
        if why:
            try:
                _emit(_WAIT_MARK + " ".join(str(why).split())[:2000])
            except Exception:  # noqa: BLE001
                pass
        return why

    _model_not_ready._tfcluster = True
    cls._model_not_ready = _model_not_ready


# The strategy a TF2 script builds, reported once per strategy object: its class and
# num_replicas_in_sync, read as StrategyBase.__init__ runs (every strategy's constructor
# builds its `extended` first and hands it over there, so the count is known). The default
# strategy (no strategy built: Keras and TF ask for it) is reported only at exit, and only
# if nothing else was built: it is created for any script that trains without one, and for
# one that builds its strategy later too.
_STRATEGY_MARK = "tfcluster-strategy: "
_strategies = []
_said = []           # what _say_once said


def _strategy_line(cls_name, replicas):
    import json
    task = "%s:%s" % (os.environ.get("TFCLUSTER_JOB", "?"), os.environ.get("TFCLUSTER_TASK_INDEX", "?"))
    return _STRATEGY_MARK + json.dumps({"task": task, "class": cls_name, "replicas": replicas},
                                       separators=(",", ":"))


def _patch_strategy(module):
    _after_init(getattr(module, "StrategyBase", None), _strategy_built)


# MultiWorkerMirroredStrategy's constructor joins every task of TF_CONFIG's cluster before it
# returns: in a mode whose tasks run tfcluster's servers (the ps and workers of coordinator
# mode) it never does. So its start is reported as it begins, with 0 replicas (not known yet).
def _patch_collective_strategy(module):
    cls = getattr(module, "CollectiveAllReduceStrategy", None)
    if cls is not None:
        _first_call(cls, "__init__", lambda strategy, *_: _emit(_strategy_line(type(strategy).__name__, 0)),
                    before=True)


def _strategy_built(strategy):
    name = type(strategy).__name__
    if name.startswith("_DefaultDistributionStrategy"):
        if not _strategies:
            import atexit
            atexit.register(_default_at_exit)
        _strategies.append(None)
        return
    _strategies.append(name)
    _emit(_strategy_line(name, strategy.num_replicas_in_sync))


def _default_at_exit():
    if not any(_strategies):
        _say_once("default", 1)


def _say_once(cls_name, replicas):
    """A report that is the same whenever it is made (no strategy, or how JAX or a fit ran): once."""
    if cls_name not in _said:
        _said.append(cls_name)
        _emit(_strategy_line(cls_name, replicas))


# Mode keras-jax: whether each JAX process joined the others before JAX started its backend
# (jax.distributed.initialize, which keras.distribution.initialize calls, is refused after
# that), and whether a Keras fit has a distribution to spread it across them. Without either
# every process trains its own copy. Reported with the strategy's mark and read the same way.
def _first_call(owner, name, then, before):
    """owner.name (a function or method) runs `then` once, at its first call: `before` the
    call, with its arguments (`then` judges what it is about to do), or after it, without."""
    original = getattr(owner, name, None)
    if original is None or getattr(original, "_tfcluster", False):
        return
    import functools
    done = []

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if not done and before:
            done.append(True)
            _quietly(then, *args)
        result = original(*args, **kwargs)  # tfcluster's start-up probe: your call, unchanged
        if not done:
            done.append(True)
            _quietly(then)
        return result

    wrapper._tfcluster = True
    setattr(owner, name, wrapper)


def _quietly(then, *args):
    try:
        then(*args)
    except Exception:  # noqa: BLE001 - the probe must never break the user's script
        pass


# JAX and Keras are read from sys.modules, as the script imported them: the probe imports
# nothing beyond the standard library.
def _jax_backend_started():
    state = sys.modules["jax._src.distributed"].global_state
    if state.client is None:
        _say_once("jax-alone", sys.modules["jax"].local_device_count())
    else:
        _say_once("jax-joined", int(state.num_processes or 0))


def _keras_fit_started(*_):
    jax = sys.modules["jax"]
    if jax.process_count() < 2:
        return                      # not joined: said when its backend started
    if sys.modules["keras.src.distribution.distribution_lib"].distribution() is None:
        _say_once("keras-no-distribution", jax.local_device_count())


# A TF2 mode's Keras fit: the strategy the model runs under. A model built and compiled
# outside `strategy.scope()` fits under TensorFlow's default strategy, on this worker alone,
# though the script built the mode's strategy (and so reported it above); a script that built
# none is said to have none now rather than at its exit.
def _tf_fit_started(model, *_):
    if not type(model.distribute_strategy).__name__.startswith("_DefaultDistributionStrategy"):
        return
    _say_once("fit-default" if any(_strategies) else "default", 1)


# Keras' `evaluate` and `predict` print the bars `fit` prints, often of the same size (the same
# dataset): the launcher counts a pass of bars between these two lines as no step of a fit
# (watch/metrics.py). One called inside `fit` (its validation) prints no bars and says nothing.
_KERAS_MARK = "tfcluster-keras: "
_keras_calls = []    # the Keras calls under way, outermost first


def _keras_call(owner, name):
    original = getattr(owner, name, None) if owner is not None else None
    if original is None or getattr(original, "_tfcluster_call", False):
        return
    import functools

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        said = name != "fit" and not _keras_calls
        _keras_calls.append(name)
        if said:
            _keras_line(name)
        try:
            return original(*args, **kwargs)  # tfcluster's start-up probe: your call, unchanged
        finally:
            _keras_calls.pop()
            if said:
                _keras_line(name + " done")

    wrapper._tfcluster_call = True
    setattr(owner, name, wrapper)


def _keras_line(text):
    try:
        sys.stdout.flush()      # the bars before it reach the log first
    except Exception:  # noqa: BLE001
        pass
    _emit(_KERAS_MARK + text)


def _keras_calls_of(cls):
    for name in ("fit", "evaluate", "predict"):
        _keras_call(cls, name)


def _patch_tf_keras_training(module):        # tf_keras (train.keras: legacy)
    _first_call(getattr(module, "Model", None), "fit", _tf_fit_started, before=True)
    _keras_calls_of(getattr(module, "Model", None))


def _patch_keras_tf_trainer(module):         # Keras 3 on TensorFlow
    _first_call(getattr(module, "TensorFlowTrainer", None), "fit", _tf_fit_started, before=True)
    _keras_calls_of(getattr(module, "TensorFlowTrainer", None))


def _patch_xla_bridge(module):
    _first_call(module, "backends", _jax_backend_started, before=False)


def _patch_jax_trainer(module):
    _first_call(getattr(module, "JAXTrainer", None), "fit", _keras_fit_started, before=True)
    _keras_calls_of(getattr(module, "JAXTrainer", None))


def _patch_jax_distributed(module):
    """An exception that ends a joined JAX process (its traceback printed: Python sets
    sys.last_value before the exit handlers run): JAX's shutdown at exit would wait at a
    barrier for the other processes, which wait for this one inside a collective, until its
    shutdown_timeout_seconds (300 s by default). The process ends there instead, exit 1 as
    Python's would, and the run stops or restarts the others at once."""
    cls = getattr(module, "State", None)
    original = getattr(cls, "shutdown", None)
    if original is None or getattr(original, "_tfcluster", False):
        return

    def shutdown(self):
        if getattr(sys, "last_value", None) is not None and getattr(self, "client", None) is not None:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001
                    pass
            os._exit(1)
        return original(self)

    shutdown._tfcluster = True
    cls.shutdown = shutdown


_TARGETS = {
    "tensorflow.python.client.session": _patch_session,
    "tensorflow.python.training.session_manager": _patch_session_manager,
    "tensorflow.python.distribute.distribute_lib": _patch_strategy,
    "tensorflow.python.distribute.collective_all_reduce_strategy": _patch_collective_strategy,
    "tf_keras.src.engine.training": _patch_tf_keras_training,
    "keras.src.backend.tensorflow.trainer": _patch_keras_tf_trainer,
    "jax._src.xla_bridge": _patch_xla_bridge,
    "jax._src.distributed": _patch_jax_distributed,
    "keras.src.backend.jax.trainer": _patch_jax_trainer,
}


class _AfterImport:
    """Patches a module right after it is executed, without importing it early."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        patch = _TARGETS.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module):
            original(module)
            try:
                patch(module)
            except Exception:  # noqa: BLE001
                pass

        loader.exec_module = exec_module
        return spec


def _unprobe_children():
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    rest = [p for p in parts if os.path.abspath(p) != _HERE]
    if rest:
        os.environ["PYTHONPATH"] = os.pathsep.join(rest)
    else:
        os.environ.pop("PYTHONPATH", None)


def _chain_user_sitecustomize():
    path = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    from importlib.util import module_from_spec  # only with a user's sitecustomize to run
    module = module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)   # its errors surface exactly as site.py shows them


def _timed_stdout(interval):
    """Replace an unbuffered (or line-buffered) stdout on a file or pipe by a buffered one
    that a daemon thread flushes every `interval` seconds; stderr stays as it is."""
    import atexit
    import threading
    import time

    old = sys.stdout
    try:
        fd = old.fileno()
        if old.isatty():
            return
        raw = io.FileIO(fd, "w", closefd=False)
    except (AttributeError, OSError, ValueError):
        return
    new = io.TextIOWrapper(io.BufferedWriter(raw, 1 << 16), encoding=old.encoding, errors=old.errors,
                           line_buffering=False, write_through=False)
    _kept.append(old)                 # its FileIO owns fd 1: collected, it would close it
    lock = threading.Lock()           # held while flushing; a fork waits for it (see below)

    def flush():
        with lock:
            new.flush()

    def loop():
        while True:
            time.sleep(interval)
            try:
                flush()
            except ValueError:        # closed by the script
                return
            except OSError:           # a full disk or a closed pipe: the script's own writes say so
                pass

    def start():
        threading.Thread(target=loop, name="tfcluster-stdout-flush", daemon=True).start()

    def before_fork():
        lock.acquire()                # no child inherits the buffer's lock taken by the flusher
        try:
            new.flush()               # nor a copy of what is pending (it would be written twice)
        except (OSError, ValueError):
            pass

    def in_child():
        lock.release()
        start()

    def at_exit():
        # The flusher must not be inside the buffer's flush when the interpreter finalizes:
        # a daemon thread frozen there keeps the buffer's lock and the last flush aborts
        # ("could not acquire lock ... at interpreter shutdown"). Take our lock and keep it.
        if lock.acquire(timeout=10):
            try:
                new.flush()
            except (OSError, ValueError):
                pass

    if sys.__stdout__ is old:
        sys.__stdout__ = new
    sys.stdout = new
    _stderr_flushes_first(new)
    os.register_at_fork(before=before_fork, after_in_parent=lock.release, after_in_child=in_child)
    atexit.register(at_exit)
    start()


def _stderr_flushes_first(out):
    """When stderr is the same file (tfcluster's logs), every Python write to it flushes
    stdout first: a warning, a log line or a traceback lands after the prints before it."""
    err = sys.stderr
    try:
        if not os.path.samestat(os.fstat(out.fileno()), os.fstat(err.fileno())):
            return
        write = err.write
    except (AttributeError, OSError, ValueError):
        return

    def flushing_write(text):
        try:
            out.flush()
        except (OSError, ValueError):
            pass
        return write(text)

    err.write = flushing_write        # the instance attribute shadows the method


_kept = []
try:
    _FLUSH = float(os.environ.get("TFCLUSTER_STDOUT_FLUSH") or 0)
except ValueError:
    _FLUSH = 0
if _FLUSH > 0:
    try:
        _timed_stdout(_FLUSH)
    except Exception:  # noqa: BLE001 - the probe must never break the user's script
        pass
_WANTED = set(os.environ.get("TFCLUSTER_PROBE", "").split(","))
if "placement" not in _WANTED:
    del _TARGETS["tensorflow.python.client.session"]
if "waits" not in _WANTED:
    del _TARGETS["tensorflow.python.training.session_manager"]
if not _WANTED.isdisjoint(("placement", "waits")) or not os.environ.get("TF_CONFIG"):
    # a TF1-style mode (the probes it asks for) or no cluster: no TF2 strategy to judge
    del _TARGETS["tensorflow.python.distribute.distribute_lib"]
    del _TARGETS["tensorflow.python.distribute.collective_all_reduce_strategy"]
    del _TARGETS["tf_keras.src.engine.training"], _TARGETS["keras.src.backend.tensorflow.trainer"]
if "jax" not in _WANTED:
    del _TARGETS["jax._src.xla_bridge"], _TARGETS["jax._src.distributed"], _TARGETS["keras.src.backend.jax.trainer"]
if _TARGETS:
    sys.meta_path.insert(0, _AfterImport)
_unprobe_children()
_chain_user_sitecustomize()

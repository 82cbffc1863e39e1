"""Does the strategy a script builds fit the mode it runs in?

`tf.distribute.MirroredStrategy()` (or OneDeviceStrategy, or no strategy at all) in
mirrored mode with two workers trains two copies of the model, each on its own host, never
synchronised: every worker exits 0 and nothing says so. The same script names its strategy,
so it is judged twice: before anything starts, from the text of the script and the files it
ships (static_warning, a warning naming FILE:LINE), and while it runs, from what each task's
probe reports as it builds its strategy (StrategyCheck: a mismatch ends the run, exit 8).
docs/design/diagnoses.md, "Strategy check". Pure: the supervisor feeds it lines.
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass

MARK = b"tfcluster-strategy: "

# what each mode's scripts must build, as the probe names its class (type(strategy).__name__)
MULTI_WORKER = "MultiWorkerMirroredStrategy"
PARAMETER_SERVER = "ParameterServerStrategy"
_CLASSES = {     # TF's class names -> the names a script writes
    "CollectiveAllReduceStrategy": MULTI_WORKER,
    "CollectiveAllReduceStrategyV1": MULTI_WORKER,
    "_CollectiveAllReduceStrategyExperimental": MULTI_WORKER,
    "ParameterServerStrategyV2": PARAMETER_SERVER,
    "ParameterServerStrategyV1": PARAMETER_SERVER,
}
# mode keras-jax: what the probe says of a JAX process (it names no TF strategy)
JAX_JOINED = "jax-joined"                   # joined the others before JAX's backend started
JAX_ALONE = "jax-alone"                     # started JAX's backend without joining: never can
KERAS_NO_DISTRIBUTION = "keras-no-distribution"   # joined, but fit with no keras.distribution
# a TF2 mode's Keras fit under TensorFlow's default strategy: a model built outside the scope
FIT_DEFAULT = "fit-default"
_SHOWN = {JAX_JOINED: "jax.distributed", JAX_ALONE: "no jax.distributed.initialize()",   # the probe's
          KERAS_NO_DISTRIBUTION: "no keras.distribution", FIT_DEFAULT: "model.fit outside strategy.scope()"}
_BUILD_MWMS = "tf.distribute.MultiWorkerMirroredStrategy()"
_BUILD_PSS = ("tf.distribute.ParameterServerStrategy("
              "tf.distribute.cluster_resolver.TFConfigClusterResolver())")
OFF = "switch the check off with train.checks.placement: false"


def shown(cls: str) -> str:
    """The name a script writes for TF's class `cls` (MirroredStrategyV1 -> MirroredStrategy)."""
    if cls in _CLASSES:
        return _CLASSES[cls]
    if cls in _SHOWN:
        return _SHOWN[cls]
    name = cls.lstrip("_")
    return name[:-2] if name.endswith(("V1", "V2")) else name


def expected(mode: str) -> str | None:
    """The strategy a script of `mode` must build; None: the mode judges none (TF1 modes)."""
    return {"mirrored": MULTI_WORKER, "coordinator": PARAMETER_SERVER,
            "keras-jax": _SHOWN[JAX_JOINED]}.get(mode)


def judged_tasks(plan) -> list[str]:
    """The tasks whose strategy is judged: in mirrored mode every worker and chief when there
    are two or more (one worker may train alone with any strategy); in coordinator mode the
    chief, the coordinator; in keras-jax mode every process when there are two or more. An
    evaluator builds none of them and is never judged."""
    scripts = [t for t in plan.tasks if t.runs_script and t.job in ("chief", "worker")]
    if plan.mode in ("mirrored", "keras-jax"):
        return [t.key for t in scripts] if len(scripts) > 1 else []
    if plan.mode == "coordinator":
        return [t.key for t in scripts if t.job == "chief"]
    return []


def mismatch(mode: str, workers: int, cls: str) -> tuple[str, str] | None:
    """(what it builds and what is wrong with it, the fix) when a script of `mode` with
    `workers` script tasks builds `cls` (TF's class name or the name a script writes, or
    "default" for no strategy); None when it fits."""
    want = expected(mode)
    name = shown(cls)
    if want is None or name == want:
        return None
    built = "no strategy (TensorFlow's default)" if cls == "default" else name
    if mode == "keras-jax":
        return _jax_mismatch(workers, cls)
    if cls == FIT_DEFAULT:
        alone = (f"each of the {workers} workers trains its own copy of the model, never synchronised"
                 if mode == "mirrored" else "the chief trains alone and the ps and workers wait")
        return (f"{_SHOWN[FIT_DEFAULT]} (the model was built or compiled outside it, so Keras fits under "
                f"TensorFlow's default strategy): {alone}",
                "build and compile the model inside `with strategy.scope():`")
    if mode == "mirrored":
        if name == PARAMETER_SERVER:
            return (f"{built}, which needs ps tasks and a coordinator",
                    f"set train.mode: coordinator with chief, ps and worker jobs, or build {_BUILD_MWMS}")
        return (f"{built}, which trains on its own host only: each of the {workers} workers "
                f"trains its own copy of the model, never synchronised",
                f"build {_BUILD_MWMS} instead (it reads TF_CONFIG, which tfcluster sets)")
    return (f"{built}: the ps and worker servers wait for a ParameterServerStrategy "
            f"coordinator, and the chief trains alone",
            f"build {_BUILD_PSS} instead")


def _jax_mismatch(processes: int, cls: str) -> tuple[str, str] | None:
    if cls == JAX_ALONE:
        return (f"JAX without joining the other processes (no keras.distribution.initialize() or "
                f"jax.distributed.initialize() before its first JAX computation): each of the "
                f"{processes} processes trains its own copy of the model, never synchronised",
                "call keras.distribution.initialize() first, before anything runs on JAX (it reads "
                "the KERAS_DISTRIBUTION_* variables tfcluster sets), or jax.distributed.initialize() "
                "in a plain JAX program")
    if cls == KERAS_NO_DISTRIBUTION:
        return (f"model.fit with no keras.distribution set: the processes joined, but each of the "
                f"{processes} fits its own copy of the model on its own devices, never synchronised",
                "set one before building the model: keras.distribution.set_distribution("
                "keras.distribution.DataParallel(devices=keras.distribution.list_devices()))")
    return None


# -- before the run: the script's text -------------------------------------------------------

def static_warning(plan) -> str | None:
    """One line when the script and its shipped files build a strategy that does not fit the
    mode and never the one that does, or in keras-jax mode never join the processes
    (plan.script_scan: what the text says); else None."""
    scan = getattr(plan, "script_scan", None)
    want = expected(plan.mode)
    judged = judged_tasks(plan)
    if scan is None or want is None or not judged:
        return None
    if plan.mode == "keras-jax":
        if scan.joins:
            return None
        return (f"{os.path.basename(plan.script)}: keras-jax mode: the script calls neither "
                f"keras.distribution.initialize() nor jax.distributed.initialize(): each of the "
                f"{len(judged)} processes would train its own copy of the model, never synchronised; call "
                f"keras.distribution.initialize() first, before anything runs on JAX")
    names = [shown(name) for name, _ in scan.strategies]
    if want in names:       # built somewhere: which one runs is the run's to say
        return None
    workers = len([t for t in plan.tasks if t.runs_script and t.job in ("chief", "worker")])
    for name, where in scan.strategies:
        found = mismatch(plan.mode, workers, name)
        if found is not None:
            what, fix = found
            return f"{where}: {plan.mode} mode: the script builds {what}; {fix}"
    return None


def tf1_mode_warning(plan) -> str | None:
    """Between-graph and classic modes run TF1-style clients (tfcluster's servers, or the
    script's own): a script that builds a TF2 multi-worker strategy wants another mode."""
    scan = getattr(plan, "script_scan", None)
    if scan is None or plan.mode not in ("between-graph", "classic"):
        return None
    for name, where in scan.strategies:
        if shown(name) == MULTI_WORKER:
            return (f"{where}: {plan.mode} mode: the script builds {MULTI_WORKER}, which starts each "
                    f"worker's server itself from TF_CONFIG; set train.mode: mirrored (workers only, no ps job)")
        if shown(name) == PARAMETER_SERVER:
            return (f"{where}: {plan.mode} mode: the script builds {PARAMETER_SERVER}, whose chief "
                    f"coordinates the ps and workers; set train.mode: coordinator (chief, ps and worker jobs)")
    return None


def tf_config_warning(plan) -> str | None:
    """A script that sets TF_CONFIG itself replaces the one tfcluster gives each task."""
    scan = getattr(plan, "script_scan", None)
    if scan is None or scan.sets_tf_config is None or plan.mode == "keras-jax":
        return None
    return (f"{scan.sets_tf_config}: the script sets TF_CONFIG itself, over the one tfcluster gives each "
            f"task (its cluster's addresses and its own task): every task would get that line's cluster "
            f"and task instead; delete the line (TensorFlow's tutorials set it for a run by hand)")


# -- while it runs: what each task reports ---------------------------------------------------

@dataclass(frozen=True)
class Report:
    task: str          # "worker:1"
    cls: str           # TF's class name, or "default"
    replicas: int


def parse(line: bytes) -> Report | None:
    at = line.find(MARK)
    if at < 0:
        return None
    try:
        data = json.loads(line[at + len(MARK):])
        return Report(str(data["task"]), str(data["class"]), int(data["replicas"]))
    except (ValueError, KeyError, TypeError):
        return None


class StrategyCheck:
    """The strategies the judged tasks report, as they come (from pump threads), and the
    first that does not fit the mode."""

    def __init__(self, mode: str, tasks: list[str], workers: int) -> None:
        self.mode, self.tasks, self.workers = mode, set(tasks), workers
        self.built: dict[str, Report] = {}
        self.mismatch: tuple[str, str] | None = None     # (message, hint)
        self._lock = threading.Lock()

    def add(self, report: Report) -> tuple[str, str] | None:
        if report.task not in self.tasks:
            return None
        with self._lock:
            self.built[report.task] = report
            found = mismatch(self.mode, self.workers, report.cls)
            if found is not None and self.mismatch is None:
                what, fix = found
                replicas = f"{report.replicas} replica{'s' if report.replicas != 1 else ''}"
                ran = self.mode == "keras-jax" or report.cls == FIT_DEFAULT     # not a strategy it built
                self.mismatch = (f"strategy mismatch: {report.task} ran {what}" if ran
                                 # 0: said as its constructor began (one that waits for its peers)
                                 else f"strategy mismatch: {report.task} builds {what}" if not report.replicas
                                 else f"strategy mismatch: {report.task} built {what} ({replicas} in sync)",
                                 f"{fix}; {OFF}")
            return self.mismatch

    def summary(self) -> str:
        with self._lock:
            reports = list(self.built.values())
        if not reports:
            return "no strategy reported"
        by_class: dict[str, list[Report]] = {}
        for r in reports:
            by_class.setdefault(shown(r.cls), []).append(r)
        if self.mode == "keras-jax":
            return "; ".join((f"{name}, {max(r.replicas for r in rs)} processes joined" if rs[0].cls == JAX_JOINED
                              else name) + " on " + ", ".join(sorted(r.task for r in rs))
                             for name, rs in by_class.items())
        return "; ".join(f"{'no strategy (the default)' if rs[0].cls == 'default' else name}, "
                         f"{max(r.replicas for r in rs)} replica(s) in sync on "
                         f"{', '.join(sorted(r.task for r in rs))}" for name, rs in by_class.items())

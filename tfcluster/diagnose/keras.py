"""Keras 3 against the TF2 strategies, named before anything runs. Pure (plan and host
infos in, a line or a verdict out); preflight.py says it.

From TF 2.16 `tf.keras` is Keras 3, whose `model.fit` runs neither
MultiWorkerMirroredStrategy nor ParameterServerStrategy; with tf_keras installed and
TF_USE_LEGACY_KERAS=1 (`train.keras: legacy`) `tf.keras` is Keras 2, which runs both.
What was tried and how each fails: docs/modes.md, "Keras".
"""
from __future__ import annotations

from collections.abc import Mapping

from tfcluster.diagnose.versions import minor, names

# mode -> (its strategy, the upstream issue that says Keras 3's model.fit cannot run it)
FIT_UNSUPPORTED = {
    "mirrored": ("MultiWorkerMirroredStrategy", "keras-team/keras#20585"),
    "coordinator": ("ParameterServerStrategy", "keras-team/keras#18624"),
}


def is_keras3(info) -> bool:
    """The host's `keras` package is Keras 3 (what `tf.keras` is there without legacy)."""
    major = (info.keras_version or "").split(".")[0]
    return major.isdigit() and int(major) >= 3


def tf_keras_problem(info) -> str | None:
    """Why this host cannot give its tasks tf_keras as `tf.keras` (None: it can, or its
    `tf.keras` is Keras 2 anyway, as before TF 2.16): tf_keras absent, or of another minor
    than its TensorFlow (each tf_keras release is built for the TF of the same minor)."""
    if not is_keras3(info) or not info.tf_version:    # no TF: the TF-missing check says so
        return None
    if not info.tf_keras_version:
        return "tf_keras is not installed"
    if info.tf_version and minor(info.tf_keras_version) != minor(info.tf_version):
        return f"its tf_keras {info.tf_keras_version} does not match its TensorFlow {info.tf_version}"
    return None


def tf_keras_requirement(tf_version: str | None) -> str:
    """`tf_keras~=2.21.0` for TF 2.21.x: the tf_keras releases made for that TensorFlow."""
    return f"tf_keras~={minor(tf_version)}.0" if tf_version else "tf_keras"


def fit_warning(plan, infos: Mapping[str, object]) -> str | None:
    """One line when the plan's script calls `.fit(`, its mode's strategy is one Keras 3's
    model.fit cannot run, Keras 3 is what `tf.keras` is on a host running the script, and
    the plan does not set legacy Keras; else None. `infos`: host -> HostInfo."""
    if plan.legacy_keras or not plan.script_fits or plan.mode not in FIT_UNSUPPORTED:
        return None
    hosts = [h for h in dict.fromkeys(t.host for t in plan.tasks if t.runs_script)
             if h in infos and is_keras3(infos[h])]
    if not hosts:
        return None
    strategy, issue = FIT_UNSUPPORTED[plan.mode]
    keras, needs = _keras_on(hosts, infos)
    scan = getattr(plan, "script_scan", None)
    at = f" ({scan.fit_at})" if scan is not None and scan.fit_at else ""     # a helper file's too
    return (f"{plan.mode} mode: {keras} cannot run model.fit{at} under {strategy} ({issue}): "
            f"set train.keras: legacy ({needs})")


def keras2_warning(plan, infos: Mapping[str, object]) -> str | None:
    """One line when the script or a file it ships uses what only Keras 2 has (the
    tutorials' tf.keras.optimizers.legacy, Metric.reset_states, a TF function called on a
    Keras input), on a host whose `tf.keras` is Keras 3, without legacy Keras; else None.
    For any script, `.fit(` or not: a custom loop fails on these lines as model.fit does."""
    scan = getattr(plan, "script_scan", None)
    if plan.legacy_keras or scan is None or not scan.keras2_only:
        return None
    hosts = [h for h in dict.fromkeys(t.host for t in plan.tasks if t.runs_script)
             if h in infos and is_keras3(infos[h])]
    if not hosts:
        return None
    keras, needs = _keras_on(hosts, infos)
    shown = "; ".join(f"{where}: {what}" for what, where in scan.keras2_only[:3])
    more = f" (and {len(scan.keras2_only) - 3} more)" if len(scan.keras2_only) > 3 else ""
    return (f"{keras}: the script uses what only Keras 2 has: {shown}{more}: set train.keras: legacy "
            f"({needs}), or port those lines to Keras 3")


def _keras_on(hosts: list[str], infos: Mapping[str, object]) -> tuple[str, str]:
    """("Keras 3.15 on a and c, Keras 3.14 on b", what legacy Keras needs there)."""
    by_version: dict[str, list[str]] = {}
    for host in hosts:
        by_version.setdefault(minor(infos[host].keras_version), []).append(host)
    keras = ", ".join(f"Keras {version} on {names(group)}" for version, group in by_version.items())
    lacking = [h for h in hosts if tf_keras_problem(infos[h])]
    needs = (f"needs tf_keras, which {names(lacking)} {'lacks' if len(lacking) == 1 else 'lack'}"
             if lacking else "tf_keras is installed")
    return keras, needs

"""The cluster spec: frozen dataclasses plus a strict YAML loader.

`load_spec(path)` returns a fully validated `Spec` or raises
`SpecError("FILE:LINE: field.path: problem")`; `layout_tasks(spec)` places every
task on a host, port and GPUs (the planner's input); `check_train_files(spec)` checks
and lists the script and files a run ships (`preview_train_files` for `plan`);
`with_train_overrides(spec, ...)` applies the command line's train settings;
`script_calls_fit(spec)` says whether the script calls Keras' `.fit(`. Nothing here
touches the network or imports TensorFlow.

Modules: model (the dataclasses and constants), yamltree (file -> checked YAML nodes,
typed scalars, the error model), addresses, schema (the sections), envs (env and which
of it is secret), layout (placement and the checks that need it), limits (sizes against
blow-ups), shipped (the files a run ships), loader (the entry points).
"""
from __future__ import annotations

from tfcluster.errors import did_you_mean
from tfcluster.spec.layout import layout_tasks
from tfcluster.spec.loader import check_train_files, load_spec, preview_train_files, with_train_overrides
from tfcluster.spec.model import (
                                   HOST_KEY_POLICIES,
                                   HOST_LOSS_POLICIES,
                                   JAX_CPU_COLLECTIVES_ENV,
                                   JOB_NAMES,
                                   KERAS_BACKEND_ENV,
                                   KERAS_CHOICES,
                                   LEGACY_KERAS_ENV,
                                   LEGACY_KERAS_VALUES,
                                   LOCAL_ADDRESSES,
                                   MAX_TASKS,
                                   MODES,
                                   PLACEHOLDERS,
                                   RESTART_POLICIES,
                                   SECRET_MARKERS,
                                   Checkpoint,
                                   Checks,
                                   Host,
                                   Job,
                                   Progress,
                                   Restart,
                                   Slot,
                                   Spec,
                                   SshSettings,
                                   Train,
                                   has_userinfo,
                                   is_secret,
                                   mask_userinfo,
)
from tfcluster.spec.shipped import script_calls_fit
from tfcluster.spec.yamltree import MAX_DEPTH, MAX_SPEC_BYTES

__all__ = [
    "HOST_KEY_POLICIES", "HOST_LOSS_POLICIES", "JAX_CPU_COLLECTIVES_ENV", "JOB_NAMES", "KERAS_BACKEND_ENV",
    "KERAS_CHOICES", "LEGACY_KERAS_ENV", "LEGACY_KERAS_VALUES",
    "LOCAL_ADDRESSES", "MAX_DEPTH", "MAX_SPEC_BYTES",
    "MAX_TASKS", "MODES", "PLACEHOLDERS", "RESTART_POLICIES", "SECRET_MARKERS",
    "Checkpoint", "Checks", "Host", "Job", "Progress", "Restart", "Slot", "Spec", "SshSettings", "Train",
    "check_train_files", "did_you_mean", "has_userinfo", "is_secret", "layout_tasks", "load_spec", "mask_userinfo",
    "preview_train_files", "script_calls_fit", "with_train_overrides",
]

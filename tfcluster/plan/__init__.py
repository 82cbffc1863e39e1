"""Spec -> Plan: a pure function (no I/O, no clock, no environment reads).

The plan says, for every host, how to reach it and which interpreter runs there,
and for every task where it runs, which GPUs it sees, its TF_CONFIG, its
environment and its exact command. Everything later (up, down, train, exec) takes
only the plan, so tests compare whole plans and nothing past this package reads the
spec. The one environment fact a plan depends on, the interpreter running
tfcluster, is an argument.
"""
from __future__ import annotations

# The package's names, wherever they live: model.py (the records and their queries), build.py
# (Spec -> Plan), view.py (the JSON view, redacted). And what commands take with a plan from
# spec and host, so that a caller imports the plan's vocabulary from one place.
from tfcluster.host import HOST_DIR
from tfcluster.plan.build import JAX_COORDINATOR_ENV, JAX_ENV, build_plan, jax_env, tf_config_json
from tfcluster.plan.model import (
    DEFAULT_PYTHON,
    ENV_DEFAULTS,
    SCRIPT_JOBS,
    SERVER_JOBS,
    CheckpointPlan,
    HostPlan,
    Plan,
    TaskPlan,
    interpreter,
    runs_in_process,
    shim_bindir,
)
from tfcluster.plan.view import REDACTED, env_redactor, plan_to_dict, redact_env, spare_to_dict
from tfcluster.spec import JOB_NAMES, Restart, mask_userinfo
from tfcluster.spec.addresses import host_port
from tfcluster.spec.model import STOP_GRACE

__all__ = [
    "DEFAULT_PYTHON", "ENV_DEFAULTS", "HOST_DIR", "JAX_COORDINATOR_ENV", "JAX_ENV", "JOB_NAMES", "REDACTED",
    "SCRIPT_JOBS", "SERVER_JOBS", "STOP_GRACE", "CheckpointPlan", "HostPlan", "Plan", "Restart", "TaskPlan",
    "build_plan", "env_redactor", "host_port", "interpreter", "jax_env", "mask_userinfo", "plan_to_dict", "redact_env", "runs_in_process",
    "shim_bindir", "spare_to_dict", "tf_config_json",
]

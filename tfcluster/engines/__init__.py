"""`tfcluster render`: the same plan as a job for another engine (docs/design/engines.md,
"Other engines"): a Kubeflow TFJob or a Slurm batch script.

Rendering reads the spec's local files and never connects to a host. The tasks on the
other engine run the shipped launcher (launch.py), which gives the unchanged training
script the environment `train` gives it: TF_CONFIG, TFCLUSTER_*, a TF server per task
in the modes that have one (mode keras-jax: JAX's coordinator, process count and id instead),
and `job:index │ ` prefixed output."""
from __future__ import annotations

from dataclasses import dataclass, field

ENGINES = ("tfjob", "slurm")


@dataclass(frozen=True)
class Rendered:
    files: tuple[tuple[str, str], ...]    # (file name, text): what --output DIR writes
    apply: str                            # one line: how to submit what was written
    notes: tuple[str, ...] = field(default=())   # what does not carry over, for stderr


def render(plan, to: str, *, image: str | None = None, namespace: str = "default") -> Rendered:
    """`plan` as files for engine `to` (one of ENGINES). Raises UsageError for what the
    engine cannot express."""
    if plan.mode == "keras-jax" and to == "tfjob":
        # The training operator writes TF_CONFIG for TensorFlow's servers; a JAX process needs
        # the coordinator's address and its process id, which no TFJob field carries.
        from tfcluster.errors import UsageError

        raise UsageError(f"render --to {to}: mode keras-jax is not rendered for Kubernetes: a TFJob "
                         f"gives TensorFlow's variables, not JAX's coordinator",
                         hint="render --to slurm runs it; on Kubernetes, an Indexed Job with a headless "
                              "Service (docs/engines.md, \"Mode keras-jax\")")
    if to == "tfjob":
        from tfcluster.engines.tfjob import render_tfjob

        return render_tfjob(plan, image=image or plan.image, namespace=namespace)
    from tfcluster.engines.slurm import render_slurm

    return render_slurm(plan)

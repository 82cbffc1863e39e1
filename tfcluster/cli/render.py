"""`render`: the spec as a job for a bigger engine (a Kubeflow TFJob, a Slurm batch script)."""
from __future__ import annotations

import os
import shlex
from typing import Optional

import typer

from tfcluster.cli.app import SpecArg, app, load, ui
from tfcluster.errors import ExitCode, UsageError
from tfcluster.localfs import write_output
from tfcluster.safetext import escape


@app.command()
def render(
    spec_path: str = SpecArg,
    to: str = typer.Option(..., "--to", metavar="ENGINE",
                           help="tfjob (Kubeflow training-operator TFJob) or slurm (an sbatch script)."),
    image: Optional[str] = typer.Option(None, "--image",
                                        help="Container image for tfjob (default: train.image)."),
    namespace: str = typer.Option("default", "--namespace", "-n",
                                  help="Kubernetes namespace of the TFJob (it names the tasks)."),
    output: Optional[str] = typer.Option(None, "--output", "-o", metavar="DIR",
                                         help="Write the file(s) into DIR (created); default: stdout."),
) -> int:
    """Write the spec as a job for a bigger engine: a Kubeflow TFJob or a Slurm batch script.

    The same training script runs there unchanged (it reads TF_CONFIG). Nothing connects
    to the spec's hosts; secrets stay out of the files (a Secret reference for tfjob, the
    submitting environment for slurm).

    \b
    Example:
      tfcluster render lab.yaml --to tfjob --image tensorflow/tensorflow:2.15.0-gpu -o k8s/
      kubectl apply --server-side -f k8s/lab-tfjob.yaml
      tfcluster render lab.yaml --to slurm -o jobs/ && cd jobs && sbatch lab.sbatch
      tfcluster plan lab.yaml --to slurm            # which Slurm rank plays which task
    """
    from tfcluster.engines import ENGINES
    from tfcluster.engines import render as render_plan

    if to not in ENGINES:
        raise UsageError(f"--to {to!r}: unknown engine; choose one of {', '.join(ENGINES)}")
    _spec, plan = load(spec_path, preview=True)
    rendered = render_plan(plan, to, image=image, namespace=namespace)
    if to != "tfjob" and image is not None:
        ui.warn(f"--image is for --to tfjob; ignored for --to {to}")
    for note in rendered.notes:
        ui.warn(note)
    if output is None:
        for name, text in rendered.files:
            text = text if len(rendered.files) == 1 else f"# --- {name}\n{text}"
            # the engines write no raw control or bidi character; should one slip in, the
            # terminal still gets it escaped (docs/design/spec-safety.md, "Spec safety")
            ui.stdout.write(text if _printable_lines(text) else escape(text, newlines=True))
        ui.stdout.flush()
        ui.info(f"next: save it and run `{rendered.apply}`")
        return ExitCode.OK
    if os.path.lexists(output) and not os.path.isdir(output):
        raise UsageError(f"-o {output}: not a directory (render writes its files into one: "
                         f"{', '.join(name for name, _ in rendered.files)})")
    for name, text in rendered.files:
        path = os.path.join(output, name)
        write_output(path, text.encode("utf-8"), "render -o")
        ui.ok(f"wrote {path}")
    ui.info(f"next: cd {shlex.quote(output)} && {rendered.apply}")    # the file names are relative
    return ExitCode.OK


def _printable_lines(text: str) -> bool:
    return text.replace("\n", "").replace("\t", "").isprintable()

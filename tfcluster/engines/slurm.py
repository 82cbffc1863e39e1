"""`render --to slurm`: the plan as one self-contained sbatch script.

Slurm chooses the nodes, so the spec's hosts become node *shapes*: node i of the
allocation (SLURM_NODEID) plays the plan's i-th host, and its SLURM_LOCALID-th task
plays that host's i-th task; slots of a smaller host stay idle. Ports are not the
spec's: step 1 asks every task's node for two free ports (its TF port and, for a ps,
a control port), step 2 runs the tasks with the cluster step 1 found, so two jobs on a
node cannot collide. The training files travel inside the script and reach each task
on srun's stdin; each task unpacks them into its own private directory.
docs/design/engines.md, "Other engines".
"""
from __future__ import annotations

import base64
import gzip
import io
import math
import tarfile

from tfcluster.engines import Rendered
from tfcluster.engines.bundle import bundle_files, launch_config, split_env
from tfcluster.errors import UsageError
from tfcluster.plan import Plan
from tfcluster.safetext import shell_word

MAX_SCRIPT_BYTES = 4 << 20     # Slurm's default max_script_size (SchedulerParameters)

# Run on every task: unpack the bundle read from stdin into a private directory, run the
# launcher from there, remove the directory whatever happens. Slurm starts it in the
# directory sbatch ran from, which `python -c` would import from first: only absolute
# entries stay on sys.path (as in the bootstrap, launch/agent/bootstrap.py).
BOOT = """\
import sys
sys.path[:] = [p for p in sys.path if p.startswith("/")]
import io, os, runpy, shutil, tarfile, tempfile
d = tempfile.mkdtemp(prefix="tfcluster-")
try:
    with tarfile.open(fileobj=io.BytesIO(sys.stdin.buffer.read()), mode="r:gz") as t:
        t.extractall(d, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    os.chdir(d)
    sys.argv = [os.path.join(d, "launch.py")] + sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    shutil.rmtree(d, ignore_errors=True)
"""


def layout(plan: Plan) -> list[tuple[str, list]]:
    """[(host, [(job, index, gpus), ...]), ...]: the plan's hosts in order, as Slurm nodes."""
    return [(h, [(t.job, t.index, list(t.gpus)) for t in plan.tasks_on(h)]) for h in plan.hosts]


def shape(plan: Plan) -> tuple[int, int, int]:
    """(nodes, tasks per node, GPUs per node): the largest host sets the shape of all."""
    hosts = layout(plan)
    per_node = max(len(tasks) for _, tasks in hosts)
    gpus = max(len({g for t in tasks for g in t[2]}) for _, tasks in hosts)
    return len(hosts), per_node, gpus


def rank_table(plan: Plan) -> list[tuple[int, int, int, str | None, str, tuple[int, ...]]]:
    """(rank, node, local id, task, spec host, GPUs) for every Slurm task; an idle one's task
    is None and its GPUs ()."""
    _, per_node, _ = shape(plan)
    rows = []
    for node, (host, tasks) in enumerate(layout(plan)):
        for local in range(per_node):
            if local < len(tasks):
                job, index, gpus = tasks[local]
                task, used = f"{job}:{index}", tuple(gpus)
            else:
                task, used = None, ()
            rows.append((node * per_node + local, node, local, task, host, used))
    return rows


def rank_cells(row) -> tuple[str, ...]:
    """A rank_table row as words: an idle task and no GPUs as "-"."""
    rank, node, local, task, host, gpus = row
    return str(rank), str(node), str(local), task or "-", host, ",".join(map(str, gpus)) or "-"


def _bundle(plan: Plan) -> bytes:
    files = bundle_files(plan, launch_config(plan, "slurm", hosts=[t for _, t in layout(plan)]))
    out = io.BytesIO()
    # mtime 0 in the gzip header and every member: the same plan renders the same bytes
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o600, 0
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


# Slurm sends --signal's signal this long before the job's time limit (up to 60 s earlier:
# its event timer's resolution). SIGUSR1 is the script contract's checkpoint request: a
# template saves at its next step and trains on, so the time limit's SIGTERM (then KILL
# after the cluster's KillWait, 30 s by default) loses at most what followed that save.
SAVE_AHEAD = 90


def _time(seconds: float) -> str:
    """--time in Slurm's D-HH:MM:SS; Slurm counts whole minutes, so round up to one."""
    minutes = max(1, math.ceil(seconds / 60))
    return f"{minutes // 1440}-{minutes % 1440 // 60:02d}:{minutes % 60:02d}:00"


def render_slurm(plan: Plan) -> Rendered:
    nodes, per_node, gpus = shape(plan)
    public, secret = split_env(plan)
    data = base64.encodebytes(_bundle(plan)).decode("ascii")
    # Every value is one quoted word: $'...' with escapes where it holds a control or bidi
    # character, so the script holds no raw one and bash expands nothing in it.
    q = shell_word
    lines = [
        "#!/bin/bash",
        f"# {plan.name}: {len(plan.tasks)} tasks ({plan.mode}), rendered by `tfcluster render --to slurm`.",
        f"# Submit: sbatch {plan.name}.sbatch    Output: {plan.name}-<job id>.out",
        "#",
        "# rank  node  local  task          spec host      GPUs (of the node's)",
        *(f"# {r:>4}  {n:>4}  {lo:>5}  {t:<12}  {h:<13}  {g}"
          for r, n, lo, t, h, g in map(rank_cells, rank_table(plan))),
        "#",
        f"#SBATCH --job-name={plan.name}",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={per_node}",
        "#SBATCH --distribution=block",
        f"#SBATCH --output={plan.name}-%j.out",
        # a checkpoint request to every task SAVE_AHEAD s before the time limit (the
        # scripts save and train on; the launcher and servers ignore it)
        f"#SBATCH --signal=USR1@{SAVE_AHEAD}",
    ]
    if gpus:
        lines.append(f"#SBATCH --gres=gpu:{gpus}")
    if plan.timeout:
        lines.append(f"#SBATCH --time={_time(plan.timeout)}")
    # the spec's python assigned alone: quotes inside "${...:-...}" are literal, and $(...) would run
    python = f'"$HOME"/{q(plan.python[2:])}' if plan.python.startswith("~/") else q(plan.python)
    lines += ["", "set -euo pipefail", "umask 077", f"PYTHON={python}",
              'PYTHON="${TFCLUSTER_PYTHON:-$PYTHON}"', ""]
    if public:
        lines.append("# the spec's env")
        lines += [f"export {k}={q(v)}" for k, v in public.items()]
    for name in secret:
        lines.append(f': "${{{name}:?set {name} in the environment you run sbatch from '
                     f'(tfcluster never writes secrets into a job script)}}"')
    lines += [
        "",
        'work="$(mktemp -d "${TMPDIR:-/tmp}/tfcluster-${SLURM_JOB_ID}.XXXXXX")"',
        "trap 'rm -rf -- \"$work\"' EXIT",
        'base64 -d > "$work/bundle.tgz" <<\'TFCLUSTER_BUNDLE\'',
        data.rstrip("\n"),
        "TFCLUSTER_BUNDLE",
        f"boot={q(BOOT)}",
        'export TFCLUSTER_TOKEN="$(od -An -N16 -tx1 /dev/urandom | tr -d \' \\n\')"',
        'TFCLUSTER_NODE_ADDRS="$("$PYTHON" -c "$boot" addrs < "$work/bundle.tgz")"',
        "export TFCLUSTER_NODE_ADDRS   # apart from the assignment: `export` would hide a failure",
        "# step 1: every task takes two free ports on its node (TF, and a ps's control port)",
        'TFCLUSTER_PORTS="$(srun --input=all --kill-on-bad-exit=1 "$PYTHON" -c "$boot" ports'
        ' < "$work/bundle.tgz")"',
        "export TFCLUSTER_PORTS",
        "# step 2: the tasks; a ps stops once every worker has told it it is done",
        'srun --input=all --kill-on-bad-exit=1 "$PYTHON" -c "$boot" run < "$work/bundle.tgz" &',
        "step=$!",
        "# SIGUSR1 to this shell (`scancel --batch --signal=USR1`, `--signal=B:USR1@...`) would end",
        "# it, and the job with it: it is the tasks' checkpoint request, passed on to them",
        "trap 'scancel --signal=USR1 \"$SLURM_JOB_ID\" || true' USR1",
        "while :; do",
        '  rc=0; wait "$step" || rc=$?',
        "  # a trapped signal ends the wait early (128 + its number) while the step goes on",
        '  if [ "$rc" -gt 128 ] && kill -0 "$step" 2>/dev/null; then continue; fi',
        '  exit "$rc"',
        "done",
        "",
    ]
    text = "\n".join(lines)
    if len(text.encode()) > MAX_SCRIPT_BYTES:
        raise UsageError(f"{plan.name}: the batch script would be {len(text.encode()) >> 10} KiB, "
                         f"past Slurm's default limit of {MAX_SCRIPT_BYTES >> 20} MiB",
                         hint="ship large data through a shared filesystem, not train.files")
    return Rendered(files=((f"{plan.name}.sbatch", text),),
                    apply=f"sbatch {plan.name}.sbatch", notes=_notes(plan, secret))


def _notes(plan: Plan, secret) -> tuple[str, ...]:
    notes = []
    hosts = layout(plan)
    if len({(len(t), len({g for x in t for g in x[2]})) for _, t in hosts}) > 1:
        nodes, per_node, gpus = shape(plan)
        notes.append(f"the spec's hosts differ in shape, and Slurm gives every node of a job the same: "
                     f"{nodes} nodes of {per_node} tasks" + (f" and {gpus} GPUs" if gpus else "")
                     + ", the smaller hosts' extra slots stay idle")
    if plan.restart.policy != "never":
        notes.append(f"train.restart ({plan.restart.policy}) does not carry over: a failed task "
                     "fails the job (srun --kill-on-bad-exit); resubmit or use sbatch --requeue")
    if plan.spares or plan.checkpoint is not None:
        notes.append("spare hosts, train.on_host_loss and train.checkpoint do not carry over: a "
                     "lost node fails the job; sbatch --requeue runs it again, from checkpoints on "
                     "a filesystem every node shares")
    if secret:
        notes.append(f"secret env {', '.join(secret)} is not in the script: set it in the "
                     "environment you run sbatch from")
    if plan.tf_ports != "open":
        notes.append(f"tf_ports: {plan.tf_ports} does not carry over: Slurm closes no port, so the "
                     "tasks' TensorFlow ports are open to every user of the nodes; run on nodes "
                     "given to you alone (sbatch --exclusive=user) or on a cluster you trust")
    return tuple(notes)

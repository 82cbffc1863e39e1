"""How plans and status look: tables for people, JSON for programs.

Commands shown for copy and paste are quoted word by word (safetext.shell_word); the UI
escapes every other control character (docs/design/spec-safety.md, "Spec safety")."""
from __future__ import annotations

import dataclasses
import json

from tfcluster.plan import Plan, TaskPlan, mask_userinfo, plan_to_dict, policy, redact_env, spare_to_dict
from tfcluster.safetext import escape, shell_word
from tfcluster.ui.units import duration, size

FILES_SHOWN = 20      # files listed by `plan` without --commands (--json lists all)


def plan_json(plan: Plan) -> dict:
    return plan_to_dict(plan, redact=True)


def _roles(task: TaskPlan, mode: str = "") -> str:
    if mode == "keras-jax":       # JAX's own words: its process id, and who serves the coordinator
        return ", ".join([f"process {task.index}", *(["coordinator"] if task.index == 0 else []), "script"])
    roles = ["chief"] if task.is_chief else []
    roles += ["server"] if task.runs_server else []
    roles += ["script"] if task.runs_script else []
    return ", ".join(roles) or "-"


def print_plan(ui, plan: Plan, *, commands: bool = False) -> None:
    rows = [
        (t.key, t.host, t.target, ",".join(map(str, t.gpus)) or "-", _roles(t, plan.mode))
        for t in plan.tasks
    ]
    ui.table(f"cluster {plan.name!r} — mode {plan.mode}, {len(plan.tasks)} tasks on "
             f"{len(plan.hosts)} host(s)", ["task", "host", "address", "GPUs", "role"], rows)
    cluster = {job: list(addrs) for job, addrs in plan.cluster}
    ui.text("cluster spec: " + json.dumps(cluster))
    ui.text("how each host is reached: " + reached(plan))
    if plan.mode == "keras-jax" and plan.tasks:
        ui.text(f"JAX coordinator: {plan.tasks[0].target} (process 0); {len(plan.tasks)} processes, "
                f"started and restarted together")
    for line in plan.idle_gpus():
        ui.warn(line)
    print_host_loss(ui, plan)
    print_files(ui, plan, FILES_SHOWN if not commands else len(plan.files))
    if not commands:
        ui.text("(--commands shows each task's command and environment)", style="dim")
        return
    for t in plan.tasks:
        ui.text(f"\n{t.key} on {t.host}", style="bold")
        if t.runs_server:
            ui.text(f"  server:  {_argv(plan.command(t, 'server'))}")
        if t.runs_script:
            ui.text(f"  script:  {_argv([mask_userinfo(a) for a in plan.command(t)])}  (in {plan.cluster_dir}/runs/<run id>)")
            for name, value in t.script_env:
                ui.text(f"  script env: {name}={shell_word(value)}  (a client: its server owns the GPU)")
            ui.text("  and at run time: TFCLUSTER_RUN_ID=<run id>, TFCLUSTER_RESTART=<restarts before>, "
                    "TFCLUSTER_STDOUT_FLUSH=0.01 (unless env: sets it), PYTHONPATH with tfcluster's start-up "
                    "probe first", style="dim")
        for name, value in redact_env(t.env, plan.secret_env, plan.public_env).items():
            ui.text(f"  {name}={shell_word(value)}")


def reached(plan: Plan) -> str:
    """How tfcluster gets to each host: this machine's own processes, or SSH with whose login,
    through which jump host, and what it does with a host key it has not seen."""
    local = [h.name for h in plan.all_hosts if h.local]
    parts = [f"{', '.join(local)} {'is' if len(local) == 1 else 'are'} this machine (no SSH)"] if local else []
    groups: dict[tuple, list[str]] = {}
    for h in plan.all_hosts:
        if not h.local:
            o = h.ssh
            groups.setdefault((o.user, o.port, o.jump_host, o.host_key_policy), []).append(h.name)
    for (user, port, jump, policy_), names in groups.items():
        how = [f"as {user}" if user else "as ~/.ssh/config names, else as you",
               *([f"port {port}"] if port else []),
               *([f"through {mask_userinfo(jump)}"] if jump else []),
               "unknown host keys refused" if policy_ == "reject" else f"unknown host keys: {policy_}"]
        parts.append(f"{', '.join(names)} over SSH ({', '.join(how)})")
    return "; ".join(parts)


def _argv(words) -> str:
    """A task's command as a shell reads it back: the host's shim expands a word that starts
    with `~/` (its home there), so the `~/` stays outside the quotes, where a shell expands it too."""
    return " ".join("~/" + shell_word(w[2:]) if w.startswith("~/") and len(w) > 2 else shell_word(w) for w in words)


WHAT_A_LOSS_DOES = {
    policy.RESTART: "every task starts again on the new cluster, from the checkpoint",
    policy.SHRINK: "the run goes on without its tasks",
    policy.FAIL: "the run ends, naming the host",
}


def host_loss_lines(plan: Plan) -> list[str]:
    """What losing a host does to this run, per kind of task it held (policy.on_host_loss):
    a spare counts where one can take every task of each host holding that kind (its GPUs,
    its ports), and a restart is from the checkpoint only where the run keeps one."""
    kinds: dict[str, tuple[policy.LostTask, set[str]]] = {}
    for t in plan.tasks:
        kind = "the chief" if t.is_chief and t.runs_script else ("a ps" if t.job == "ps" else f"a {t.job}")
        kinds.setdefault(kind, (policy.LostTask(t.job, t.is_chief and t.runs_script), set()))[1].add(t.host)
    lines = []
    for kind, (task, hosts) in kinds.items():
        problems = {h: {s: plan.spare_problem(s, h) for s in plan.spares} for h in sorted(hosts)}
        uncovered = [h for h, by_spare in problems.items() if None not in by_spare.values()]
        action, why = policy.on_host_loss(plan.mode, plan.on_host_loss, [task], not uncovered)
        if action == policy.FAIL and plan.spares and uncovered and plan.on_host_loss != policy.FAIL:
            why = f"no spare can take {uncovered[0]}'s tasks: " + "; ".join(
                f"{s} {problem}" for s, problem in problems[uncovered[0]].items())
        what = WHAT_A_LOSS_DOES[action]
        if action == policy.RESTART and plan.checkpoint is None:
            what = ("every task starts again on the new cluster, from the script's own checkpoint if it "
                    "keeps one (no train.checkpoint)")
        lines.append(f"  holding {kind}: {what} ({why})")
    return lines


def print_host_loss(ui, plan: Plan) -> None:
    """The spares, what each could take, what a lost host does to the run, the checkpoints."""
    if plan.spares:
        rows = [_spare_row(spare_to_dict(plan, name)) for name in plan.spares]
        ui.table(f"{len(plan.spares)} spare host(s): no task until a host is lost",
                 ["spare", "address", "GPUs", "could take the tasks of"], rows)
    ui.text(f"on a lost host (train.on_host_loss: {plan.on_host_loss}):")
    for line in host_loss_lines(plan):
        ui.text(line)
    for lost, spare in plan.moves:
        ui.text(f"moved: {lost}'s tasks run on {spare}")
    watched = [h for h in plan.all_hosts if h.preemptible != "no"]
    if watched:     # a host that warns before it goes (docs/hostloss.md, "When a host warns")
        ui.text("on a notice (a host about to be taken back), its tasks drain first:")
        for h in plan.all_hosts:
            ui.text(f"  {h.name}: {h.watched}")
    ckpt = plan.checkpoint
    if ckpt is not None:
        copied = (f"the newest complete one copied here every {duration(ckpt.sync)}" if ckpt.sync is not None
                  else "not copied here (sync: off, a filesystem every host shares)")
        ui.text(f"checkpoints: {ckpt.dir} on the chief's host, {ckpt.keep} kept, {copied}")


def _spare_row(spare: dict) -> tuple[str, ...]:
    takes = ", ".join(spare["takes"]) or "none"
    if spare["holds"]:
        takes = f"holds {', '.join(spare['holds'])}"
    cannot = "; ".join(f"not {h}: {why}" for h, why in spare["cannot_take"].items())
    return spare["name"], spare["address"], str(spare["gpus"] or "-"), takes + (f" ({cannot})" if cannot else "")


def print_files(ui, plan: Plan, most: int) -> None:
    """What a run ships (the first `most` files), or why train would refuse to."""
    if plan.files_problem:
        ui.warn(f"train would refuse this spec: {plan.files_problem}")
    unshipped = plan.script_scan.unshipped_line() if plan.script_scan else None
    if unshipped:
        ui.warn(unshipped)
    if not plan.files:
        return
    total = sum(nbytes for _, _, nbytes in plan.files)
    ui.text(f"ships {len(plan.files)} file(s), {size(total)}, into each script host's run directory:")
    for path, dest, nbytes in plan.files[:most]:
        ui.text(f"  {path} → {dest} ({size(nbytes)})")
    if len(plan.files) > most:
        ui.text(f"  … and {len(plan.files) - most} more (--commands or --json lists them all)", style="dim")


VERSION_COLUMNS = ("host", "python", "tensorflow", "keras", "cuda/cudnn", "driver", "GPUs")


def keras_cell(info) -> str:
    """`3.15.1`, `3.15.1 + tf_keras 2.21.0`, `tf_keras 2.21.0` or `-`: which Keras `tf.keras`
    can be on that host (docs/modes.md, "Keras")."""
    parts = [info.keras_version] if info.keras_version else []
    parts += [f"tf_keras {info.tf_keras_version}"] if info.tf_keras_version else []
    return " + ".join(parts) or "-"


def jax_cell(info) -> str:
    """`0.10.2`, `0.10.2 / jaxlib 0.10.1` (they differ), with ` (cuda)` where its CUDA plugin
    is installed, or `MISSING`."""
    if not info.jax_version:
        return "MISSING"
    same = info.jaxlib_version == info.jax_version
    return (info.jax_version + ("" if same else f" / jaxlib {info.jaxlib_version or '?'}")
            + (" (cuda)" if info.jax_cuda_version else ""))


def version_table(infos: dict, odd: dict[str, list[str]], mode: str = "") -> tuple:
    """(title, columns, rows) of the hosts' versions (host -> HostInfo); `odd`: host -> the
    fields it differs in, marked in a last column. For ui.table, or ui.table_text (an
    error's details). Mode keras-jax has a jax column and needs no TensorFlow."""
    jax = mode == "keras-jax"

    def row(host: str, info) -> tuple[str, ...]:
        build = (info.cuda_version, info.cudnn_version)
        cells = (host, info.python_version, info.tf_version or ("-" if jax else "MISSING"), keras_cell(info),
                 *((jax_cell(info),) if jax else ()),
                 " / ".join(v or "?" for v in build) if any(build) else "-",
                 info.driver_version or "-", str(info.gpus))
        if not odd:
            return cells
        return cells + (f"← differs ({', '.join(odd[host])})" if host in odd else "",)

    rows = [row(host, info) for host, info in infos.items()]
    columns = VERSION_COLUMNS[:4] + ("jax",) + VERSION_COLUMNS[4:] if jax else VERSION_COLUMNS
    return f"versions on {len(rows)} host(s)", columns + (("",) if odd else ()), rows


def status_json(plan: Plan, rows) -> dict:
    return {"name": plan.name, "tasks": [dataclasses.asdict(r) for r in rows]}


def print_status(ui, plan: Plan, rows) -> None:
    table_rows = [
        (r.task, r.host, r.address, r.status if r.in_spec else "running, not in spec", str(r.pid or "-"),
         duration(r.uptime_s), {True: "yes", False: "no", None: "?"}[r.port_open])
        for r in rows
    ]
    # "listening", not "open": with the fence up, a port that listens is closed to everyone else
    ui.table(f"cluster {plan.name!r}", ["task", "host", "address", "status", "pid", "uptime", "listening"],
             table_rows)
    planned = [r for r in rows if r.in_spec]
    running = sum(1 for r in planned if r.status == "running")
    ui.info(f"{running}/{len(planned)} tasks running")
    changed = "the spec changed since these were started"
    for r in rows:
        if r.started_port is not None:
            ui.warn(f"{r.host}: {r.task} runs on port {r.started_port}, not the spec's {r.address} "
                    f"({changed}); {plan.again('down')} stops it (by its tag), then {plan.again('up')} starts "
                    f"it as the spec says")
    for host in dict.fromkeys(r.host for r in rows if not r.in_spec):
        tasks = [r.task for r in rows if r.host == host and not r.in_spec]
        ui.warn(f"{host}: {', '.join(tasks)} of cluster {plan.name!r} {_runs(tasks)} but the spec has no "
                f"such task there ({changed}); {plan.again('down')} stops {_them(tasks)}")
    for host in dict.fromkeys(r.host for r in rows if r.pid_file is False):
        tasks = [r.task for r in rows if r.host == host and r.pid_file is False]
        ui.warn(f"{host}: {', '.join(tasks)} of cluster {plan.name!r} {_runs(tasks)} with no pid file "
                f"(the cluster's directory there was removed or replaced); {plan.again('down')} stops {_them(tasks)}")


def watched_json(plan: Plan, published: dict[str, dict]) -> dict[str, dict]:
    """host -> what the spec asks to watch for, what the running (or last) train's notice
    stream found there, and the latest notice; every host, for `status --json`."""
    return {h.name: {"preemptible": h.preemptible, "spec": h.watched,
                     "stream": published.get(h.name, {}).get("stream"),
                     "notice": published.get(h.name, {}).get("notice")} for h in plan.all_hosts}


def print_watched(ui, watched: dict[str, dict]) -> None:
    """What each host is watched for, once any is (docs/hostloss.md, "When a host warns"):
    the spec's word, and what the train's stream found (`aws spot`, or why none answered)."""
    if all(w["preemptible"] == "no" and not w["stream"] for w in watched.values()):
        return
    ui.text("notices (a host about to be taken back):")
    for host, w in watched.items():
        found = f"; the train's stream: {w['stream']}" if w["stream"] else ""
        ui.text(f"  {host}: {w['spec']}{found}" + (f"; last notice: {w['notice']}" if w["notice"] else ""))


def _runs(tasks: list) -> str:
    return "runs" if len(tasks) == 1 else "run"


def _them(tasks: list) -> str:
    return "it" if len(tasks) == 1 else "them"


SUMMARY_LINE = 60     # characters of a task's last loss line in the summary


def clip(text: str, width: int = SUMMARY_LINE) -> str:
    """Keep the start of a line (where `step=` and `loss=` are) and mark the cut with …"""
    return text if len(text) <= width else text[:width - 1] + "…"


def print_summary(ui, run_id: str, rows: list[tuple[str, ...]], outcome: tuple[int, str],
                  saved: str, checks: dict[str, str] | None = None,
                  steps: dict[str, tuple[str, str]] | None = None) -> None:
    """The run's table (task, host, exit, restarts, duration, [final step, steps/s,] last
    loss line) and outcome; `steps`: task -> (final step, steps/s) as text."""
    if rows:
        extra = ["step", "steps/s"] if steps is not None else []
        ui.table(f"run {run_id}", ["task", "host", "exit", "restarts", "duration", *extra, "last loss line"],
                 [(*row[:-1], *(steps.get(row[0], ("-", "-")) if steps is not None else ()),
                   clip(escape(row[-1]))) for row in rows], stderr=True)
    for name, result in (checks or {}).items():
        ui.info(f"{name} check: {result}")
    code, text = outcome
    (ui.ok if code == 0 else ui.info)(f"{text} — logs in {saved}/")

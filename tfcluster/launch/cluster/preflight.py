"""Preflight: are the hosts fit for these tasks? TensorFlow importable, GPUs present,
no two tasks on one machine sharing a port, and every port free; and do the hosts agree
on their Python and TensorFlow versions (versions.py), have the tf_keras legacy Keras
needs, and can their Keras run the script's model.fit (keras.py, a warning). Nothing is
started."""
from __future__ import annotations

import ipaddress

from tfcluster.diagnose import keras, strategy, versions
from tfcluster.errors import ExitCode, PreflightError, TfclusterError
from tfcluster.launch.agent.fence import idle_spare
from tfcluster.launch.cluster import state
from tfcluster.launch.cluster.session import Session, by_host, raise_first
from tfcluster.plan import Plan, TaskPlan, names
from tfcluster.safetext import shell_join
from tfcluster.ui.views import version_table


def preflight(session: Session, tasks: list[TaskPlan], *, ports: bool = True,
              busy: dict[tuple[str, int], str | None] | None = None) -> None:
    """`ports`: the tasks bind their ports, so those must be free (`busy`: (host, port) ->
    holder from a survey already made, else the ports are asked now)."""
    infos = session.infos
    for name in dict.fromkeys(t.host for t in tasks):
        info, host = infos[name], session.plan.host(name)
        if session.plan.mode == "keras-jax":
            _check_jax_host(session, name)
        elif not info.tf_version:
            raise PreflightError(
                f"host {name}: tensorflow is not installed for {host.python}",
                hint="install it there, e.g. `" + shell_join(
                    ["tfcluster", "exec", session.plan.spec_path, "--hosts", name, "--", host.python, "-m", "pip",
                     "install", "tensorflow"]) + "`, or set `python:` in the spec")
        if host.gpus and info.gpus < host.gpus:
            raise PreflightError(f"host {name}: the spec gives it {host.gpus} GPUs but it has {info.gpus}")
        if session.plan.mode == "keras-jax" and (problem := _jax_device_problem(host, info)):
            raise PreflightError(f"host {name}: {problem}", hint=_jax_cuda_hint(session, name, info))
    if session.plan.mode == "keras-jax":
        _check_gloo_addresses(session, tasks)
    if ports:
        _check_same_machine_ports(infos, tasks)
        _check_ports_free(session, tasks, busy)


CUDA13_DRIVER = 580    # CUDA 13 needs an NVIDIA driver of 580 or later; CUDA 12 runs on 525 on


def jax_cuda_extra(driver: str | None) -> str:
    """jax's extra with the CUDA plugin a host's driver runs: `cuda13` from driver 580 on
    (a GPU machine here: 580.159.04), else `cuda12` (the one older drivers run)."""
    try:
        major = int((driver or "").split(".")[0])
    except ValueError:
        major = 0
    return "cuda13" if major >= CUDA13_DRIVER else "cuda12"


def _check_jax_host(session: Session, name: str) -> None:
    """Mode keras-jax needs no TensorFlow, but the backend it sets (KERAS_BACKEND=jax) must exist:
    without jax a Keras script fails at its import, a JAX one at once."""
    host = session.plan.host(name)
    if not session.infos[name].jax_version:
        raise PreflightError(
            f"host {name}: jax is not installed for {host.python} (mode keras-jax runs every process on it)",
            hint="install it there, e.g. `" + shell_join(
                ["tfcluster", "exec", session.plan.spec_path, "--hosts", name, "--", host.python, "-m", "pip",
                 "install", f"jax[{jax_cuda_extra(session.infos[name].driver_version)}]" if host.gpus else "jax"])
            + "` (the same version on every host), or set `python:` in the spec")


def _jax_device_problem(host, info) -> str | None:
    """A GPU host whose jax has no CUDA plugin runs its processes on the CPU (jax falls back with
    a warning): other devices than the rest of the job's, or than the spec says."""
    if host.gpus and info.jax_version and not info.jax_cuda_version:
        return (f"jax {info.jax_version} has no CUDA plugin for {host.python}: its processes would run on "
                f"the CPU, not on the {host.gpus} GPUs the spec gives it")
    return None


def _jax_cuda_hint(session: Session, name: str, info) -> str:
    host = session.plan.host(name)
    return ("install the plugin of the same version there, e.g. `" + shell_join(
        ["tfcluster", "exec", session.plan.spec_path, "--hosts", name, "--", host.python, "-m", "pip", "install",
         f"jax[{jax_cuda_extra(info.driver_version)}]=={info.jax_version}"])
            + "`, or drop `gpus:` from the host to run on its CPU")


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def _check_gloo_addresses(session: Session, tasks: list[TaskPlan]) -> None:
    """JAX's CPU collectives (gloo) tell the other processes to connect back to the address the
    host's own hostname resolves to there: jax gives gloo no interface to use. Where that is a
    loopback address and the processes are on other hosts, every process fails at its first
    collective with a gloo connect timeout; said here instead, with the fix."""
    hosts = [session.plan.host(name) for name in dict.fromkeys(t.host for t in tasks)]
    if all(_loopback(h.address) for h in hosts):
        return                                  # one machine: loopback reaches every process
    for host in hosts:
        found = session.infos[host.name].hostname_address
        if host.gpus or not found or (found[1] and not _loopback(found[1])):
            continue
        name, address = found
        said = f"resolves to {address}" if address else "does not resolve"
        raise PreflightError(
            f"host {host.name}: its hostname {name!r} {said} there; JAX's CPU collectives (gloo) give "
            f"the other processes that address to connect back to, so every process would fail at its "
            f"first collective (gloo: connect timeout)",
            hint=f"map {name} to the address the other hosts reach it at in its /etc/hosts "
                 f"(e.g. `{host.address} {name}`), ahead of any loopback line for it")


def check_started_ports(plan: Plan, servers: list[TaskPlan], live: dict) -> None:
    """A live server (task key -> TaskStatus) the spec no longer has, or whose pid file records
    another port than the spec's: the spec changed since `up`, and reusing the cluster would
    leave a server of no task running, or the spec's port closed."""
    gone = sorted(set(live) - {t.key for t in servers})
    if gone:       # their TF servers were started with a cluster that has them: not this spec's
        raise TfclusterError(
            f"cluster {plan.name!r} runs {len(gone)} server(s) the spec no longer has: {', '.join(gone)}",
            hint=f"run {plan.again('down')} (it stops every server of the cluster), then "
                 f"{plan.again('up')} or {plan.again('train')}")
    for task in servers:
        st = live.get(task.key)
        if st is not None and st.port is not None and st.port != task.port:
            raise PreflightError(
                f"host {task.host}: {task.key} runs on port {st.port}, not the spec's {task.port} "
                f"(the spec changed since it was started)",
                hint=f"run {plan.again('down')} (it stops the cluster's servers by their tag, whatever "
                     f"their port), then {plan.again('up')}")


def check_moved_beside_live(plan: Plan, live: dict) -> None:
    """A host down now whose servers this `up` (or `train`) would start on a spare, while servers started
    before it still run: those read the cluster's addresses once, at their start, and dial the
    down host's (a ps pulls from each worker), so the moved server would never be reached."""
    saved = state.load(state.key(plan))
    before = set(saved.moves) if saved is not None else set()
    new = [(lost, spare) for lost, spare in plan.moves if (lost, spare) not in before]
    if not (new and live):
        return
    hosts = ", ".join(lost for lost, _ in new)
    raise TfclusterError(
        f"{hosts} is down, and its servers would start on {', '.join(s for _, s in new)} beside "
        f"{', '.join(sorted(live))}, which run with {hosts}'s address in their cluster spec (a TF server "
        f"reads it once, at its start): nothing started",
        hint=f"run {plan.again('down')} (what it cannot reach is left for when the host is back), then "
             f"{plan.again('up')} (or {plan.again('train')}) starts every server with the spare's address",
        exit_code=ExitCode.CONNECT)


def check_versions(session: Session, *, allow_skew: bool, report: bool = False) -> None:
    """Hosts on another Python or TensorFlow minor version than the rest: an error (exit 4)
    with the version table before it, or with `allow_skew` the table and a warning. The
    table is printed anyway with `report` (`plan --check`). Then each host's Keras: a host
    without the tf_keras legacy Keras needs is an error, and a Keras 3 that cannot run the
    script's model.fit a warning. An idle spare is checked apart: a problem there sets it
    aside with a warning (check_spares)."""
    check_spares(session)
    infos = {h: session.infos[h] for h in session.host_names
             if h in session.infos and not idle_spare(session.plan, h)}
    mode = session.plan.mode
    skews = versions.find_skews(infos, mode)
    shown = {h: session.infos[h] for h in session.host_names if h in session.infos}   # usable spares too
    table = version_table(shown, versions.odd_fields(skews), mode)
    if skews and not allow_skew:
        what = ("the same jax, jaxlib and Keras versions and Python minor version" if mode == "keras-jax"
                else "the same Python and TensorFlow minor versions")
        raise PreflightError(
            versions.message(skews), details=session.ui.table_text(*table),
            hint=f"install {what} on every host (the table marks the odd ones), or pass --allow-skew to go on "
                 f"anyway")
    if skews or report:
        session.ui.table(*table, stderr=True)
    if skews:
        session.ui.warn(f"{versions.message(skews)} (going on: --allow-skew)")
    if session.plan.legacy_keras:
        check_tf_keras(session, list(infos))
    for warning in (keras.fit_warning(session.plan, infos), keras.keras2_warning(session.plan, infos),
                    strategy.static_warning(session.plan), strategy.tf1_mode_warning(session.plan),
                    strategy.tf_config_warning(session.plan), *unused_gpus(session.plan, infos),
                    *session.plan.idle_gpus()):
        if warning:
            session.ui.warn(warning)


def unused_gpus(plan, infos) -> list[str]:
    """A host whose GPUs the spec does not give (no `gpus:`): every task there runs with an
    empty CUDA_VISIBLE_DEVICES, so on the CPU, with nothing said. `gpus: 0` means it."""
    out = []
    for name, info in infos.items():
        host = plan.host(name)
        if info.gpus and not host.gpus and not host.gpus_set and plan.tasks_on(name):
            out.append(f"host {name} has {info.gpus} GPU(s) but the spec gives it none, so its tasks run on the "
                       f"CPU (CUDA_VISIBLE_DEVICES is empty for them): set `gpus: {info.gpus}` on the host to "
                       f"use them (and `per_gpu: true` on a job for a task per GPU), or `gpus: 0` to say the "
                       f"CPU is meant")
    return out


def check_spares(session: Session) -> None:
    """Each idle spare as a host with tasks would be checked (TensorFlow there, its GPUs,
    the hosts' Python and TensorFlow minor versions, tf_keras for legacy Keras): a spare
    that fails is set aside with a warning, never the run's failure."""
    plan, infos = session.plan, session.infos
    working = [i for h, i in infos.items() if h in session.host_names and not idle_spare(plan, h)]
    problems = {}
    for name in [h for h in session.host_names if idle_spare(plan, h) and h in infos]:
        problem = _spare_problem(plan.host(name), infos[name], working, plan.legacy_keras, plan.mode)
        if problem:
            problems[name] = problem
    session.set_aside(problems)


def _spare_problem(host, info, working: list, legacy: bool, mode: str = "") -> str | None:
    jax = mode == "keras-jax"
    if jax and not info.jax_version:
        return f"jax is not installed for {host.python}"
    if not jax and not info.tf_version:
        return f"tensorflow is not installed for {host.python}"
    if host.gpus and info.gpus < host.gpus:
        return f"the spec gives it {host.gpus} GPUs but it has {info.gpus}"
    if jax and (problem := _jax_device_problem(host, info)):
        return problem
    for what, attr in versions.JAX_FIELDS if jax else versions.FIELDS:
        key = versions.minor if not jax or what == "Python" else str
        mine = getattr(info, attr)
        theirs = sorted({v for i in working if (v := getattr(i, attr))}, key=versions.minor)
        if mine and theirs and key(mine) not in {key(v) for v in theirs}:
            return f"{what} {mine}, but the hosts with tasks have {', '.join(theirs)}"
    problem = keras.tf_keras_problem(info) if legacy else None
    return f"legacy Keras needs tf_keras, but {problem}" if problem else None


def check_tf_keras(session: Session, hosts: list[str]) -> None:
    """Legacy Keras (TF_USE_LEGACY_KERAS=1) on a host without a matching tf_keras: TF would
    warn and give the tasks Keras 3 anyway. One line per host, with its install command."""
    bad = {h: p for h in hosts if (p := keras.tf_keras_problem(session.infos[h]))}
    if not bad:
        return
    lines = {}
    for name, problem in bad.items():
        host, info = session.plan.host(name), session.infos[name]
        command = shell_join(["tfcluster", "exec", session.plan.spec_path, "--hosts", name, "--", host.python,
                              "-m", "pip", "install", "--no-deps", keras.tf_keras_requirement(info.tf_version)])
        message = (f"host {name}: legacy Keras (TF_USE_LEGACY_KERAS=1, train.keras: legacy) needs "
                   f"tf_keras for {host.python}, but {problem}")
        lines[name] = (message, f"`{command}`")
    if len(bad) == 1:
        (message, command), = lines.values()
        raise PreflightError(message, hint=f"install it there: {command}")
    raise PreflightError(
        f"legacy Keras (TF_USE_LEGACY_KERAS=1, train.keras: legacy) needs tf_keras matching TensorFlow "
        f"on every host, and {versions.names(list(bad))} lack it",
        details="\n".join(f"{message}; install it: {command}" for message, command in lines.values()),
        hint="install it on each host as listed")


def _check_same_machine_ports(infos: dict, tasks: list[TaskPlan]) -> None:
    seen: dict[tuple[str, int], TaskPlan] = {}
    for task in tasks:
        machine = infos[task.host].machine_id or task.host
        other = seen.setdefault((machine, task.port), task)
        if other is not task and other.host != task.host:
            raise PreflightError(
                f"hosts {other.host} and {task.host} are the same machine (machine id, boot and network namespace) and "
                f"{other.key} and {task.key} both use port {task.port}; a TF server binds every interface",
                hint="give the tasks different ports")


def _check_ports_free(session: Session, tasks: list[TaskPlan], busy=None) -> None:
    if busy is None:
        grouped = by_host(tasks)
        results = session.parallel(
            lambda h: session.agents[h].check_ports([t.port for t in grouped[h]]), grouped)
        raise_first(results, "host")
        busy = {(h, port): holder for h, ports in results.items() for port, holder in ports.items()}
    for task in tasks:
        holder = busy.get((task.host, task.port))
        if holder:
            raise PreflightError(
                f"host {task.host}: port {task.port} for {task.key} is already in use ({holder})",
                hint=_busy_hint(session.plan.name, holder))


def _busy_hint(cluster: str, holder: str) -> str:
    other = names.other_workdir(holder, cluster)
    if other:
        return f"it looks like {other}"
    another = names.other_cluster(holder, cluster)      # a renamed spec's old cluster, or another one
    if another:
        return f"it is {another}, or change the port in this spec"
    return "stop whatever holds it (`tfcluster down` if it is an old cluster), or change the port in the spec"

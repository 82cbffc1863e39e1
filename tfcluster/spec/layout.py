"""Task placement: which host, port and GPUs each task gets, and the checks that need it.

`layout_tasks(spec)` is the planner's input. The cross checks (ports that collide on one
machine, job counts a mode needs) run on the placed tasks because only then is it known
which tasks share a machine.
"""
from __future__ import annotations

from collections.abc import Iterator

from tfcluster.errors import SpecError
from tfcluster.spec.addresses import machine_of
from tfcluster.spec.model import JOB_NAMES, Host, Job, Slot, Spec
from tfcluster.spec.yamltree import spec_error, sub_field

_LOOPBACK_NOTE = "127.0.0.x addresses are one machine and a TF server binds every interface"


def layout_tasks(spec: Spec) -> tuple[Slot, ...]:
    """Every task of the spec on its host, port and GPUs, in JOB_NAMES then index order.

    Pure and deterministic. Count jobs go round-robin over their hosts (ports count up per
    host), per_gpu jobs give each GPU of each host one task, explicit tasks keep list order.
    GPU ids come from one counter per host, consumed in that same order. Raises SpecError
    when a host is asked for more GPUs than it has.
    """
    hosts = {h.name: h for h in spec.hosts}
    order = {name: i for i, name in enumerate(JOB_NAMES)}
    every = spec.train.mode == "keras-jax"
    placed = [p for job in sorted(spec.jobs, key=lambda j: order[j.name])
              for p in _place(job, hosts, all_gpus=_takes_all(job, every))]
    return tuple(_assign_gpus(spec.path, placed, hosts, every))


def _takes_all(job: Job, jax: bool) -> bool:
    """Mode keras-jax, no `gpus:` written: each worker takes every GPU of its host (JAX's one
    process per host). It takes no other job: those are refused by name, not by GPU count."""
    return jax and not job.gpus_set and job.name == "worker"


def _assign_gpus(path: str, placed: list[tuple[Job, int, str, int, int]],
                 hosts: dict[str, Host], jax: bool = False) -> Iterator[Slot]:
    need: dict[str, int] = {}          # totals, so the error says what the host would need
    for _, _, host, _, k in placed:
        need[host] = need.get(host, 0) + k
    used: dict[str, int] = {}
    for job, index, host, port, k in placed:
        start = used.get(host, 0)
        if start + k > hosts[host].gpus:
            taken = _takes_all(job, jax)
            raise spec_error(path, job.line, sub_field("jobs", job.name),
                             f"host {host} has {hosts[host].gpus} GPUs but its tasks need {need[host]}"
                             + (" (mode keras-jax gives each process every GPU of its host)" if taken else ""),
                             "one worker task per host, or one per GPU (per_gpu: true), or set "
                             "jobs.worker.gpus" if taken else None)
        used[host] = start + k
        yield Slot(job.name, index, host, port, tuple(range(start, start + k)))


def _place(job: Job, hosts: dict[str, Host], all_gpus: bool = False) -> list[tuple[Job, int, str, int, int]]:
    """(job, index, host, port, gpus per task) for each task of one job. `all_gpus` (mode
    jax, no `gpus:` written): each task gets every GPU of its host, JAX's one process per host."""
    if job.tasks is not None:
        return [(job, i, h, p, hosts[h].gpus if all_gpus else job.gpus) for i, (h, p) in enumerate(job.tasks)]
    port = job.port or 0
    if job.per_gpu:
        pairs = [(h, port + g) for h in job.hosts for g in range(hosts[h].gpus)]
        return [(job, i, h, p, 1) for i, (h, p) in enumerate(pairs)]
    n = len(job.hosts)
    return [(job, i, job.hosts[i % n], port + i // n, hosts[job.hosts[i % n]].gpus if all_gpus else job.gpus)
            for i in range(job.count or 0)]


def per_host(job: Job, hosts: dict[str, Host]) -> dict[str, int]:
    """How many tasks of a count/per_gpu job land on each of its hosts (as _place puts them)."""
    if job.per_gpu:
        return {name: hosts[name].gpus for name in job.hosts}
    n = len(job.hosts)
    return {name: (job.count or 0) // n + (i < (job.count or 0) % n)
            for i, name in enumerate(job.hosts)}


def task_count(job: Job, hosts: dict[str, Host]) -> int:
    if job.tasks is not None:
        return len(job.tasks)
    return sum(per_host(job, hosts).values())


# --------------------------------------------------------------------------- cross checks

def check_conflicts(spec: Spec, slots: tuple[Slot, ...]) -> None:
    hosts = {h.name: h for h in spec.hosts}
    machines = {h.name: machine_of(h.address) for h in spec.hosts}   # once per host, not per task
    seen: dict[tuple[str, int], Slot] = {}
    for slot in slots:
        host = hosts[slot.host]
        if not host.local and slot.port == (host.ssh.port or 22):
            job = spec.job(slot.job)
            said = "its `ssh.port`" if host.ssh.port else "SSH's default port"
            raise spec_error(spec.path, job.line if job else None, sub_field("jobs", slot.job),
                             f"{slot.job}:{slot.index} uses port {slot.port} of {host.name}, {said}, where "
                             f"tfcluster reaches the host: its TF server could not listen there",
                             "give the job another port")
        key = (machines[slot.host], slot.port)
        first = seen.setdefault(key, slot)
        if first is not slot:
            job = spec.job(slot.job)
            raise spec_error(spec.path, job.line if job else None, sub_field("jobs", slot.job),
                              _conflict(slot, first, hosts))


def _conflict(slot: Slot, first: Slot, hosts: dict[str, Host]) -> str:
    both = f"{slot.job}:{slot.index} and {first.job}:{first.index} both use"
    a, b = hosts[slot.host], hosts[first.host]
    if a.name == b.name:
        return f"{both} {a.name}:{slot.port}"
    if a.address == b.address:
        return f"{both} port {slot.port} of {a.address} (hosts {a.name} and {b.name})"
    return (f"{both} port {slot.port} of this machine (hosts {a.name} at {a.address} and "
            f"{b.name} at {b.address}): {_LOOPBACK_NOTE}")


def check_loopback_mix(spec: Spec, slots: tuple[Slot, ...]) -> None:
    """A task dials every other task at its host's address: a loopback address in a cluster
    that also has other hosts would make the tasks on those hosts dial themselves. A spare
    counts as used: a lost host's tasks may move there."""
    used = dict.fromkeys(s.host for s in slots)
    hosts = [(i, h) for i, h in enumerate(spec.hosts) if h.name in used or h.spare]
    loop = [(i, h) for i, h in hosts if machine_of(h.address) == "loopback"]
    other = [h for _, h in hosts if machine_of(h.address) != "loopback"]
    if loop and other:
        i, h = loop[0]
        raise spec_error(
            spec.path, h.line, sub_field(sub_field("hosts", i), "address"),
            f"host {h.name} is at loopback address {h.address} but host {other[0].name} is at "
            f"{other[0].address}: tasks on {other[0].name} would dial {h.address} and reach "
            f"themselves, not {h.name}",
            hint=f"give host {h.name} an address the other hosts reach (its hostname or IP), or "
                 f"put every task on loopback")


def check_mode(spec: Spec, slots: tuple[Slot, ...], jobs_line: int) -> None:
    mode = spec.train.mode
    have = {name: sum(1 for s in slots if s.job == name) for name in JOB_NAMES}

    def bad(name: str, problem: str, hint: str | None = None) -> SpecError:
        job = spec.job(name)
        field = sub_field("jobs", name) if job else "jobs"
        return spec_error(spec.path, job.line if job else jobs_line, field, problem, hint)

    if have["chief"] > 1:
        raise bad("chief", f"at most 1 chief task, got {have['chief']}")
    if not have["worker"]:
        raise bad("worker", f"mode {mode} needs at least one worker task")
    if mode == "keras-jax":
        _check_jax(slots, have, bad)
        return
    if mode != "mirrored" and not have["ps"]:
        raise bad("ps", f"mode {mode} needs at least one ps task",
                  hint="add ps: {count: 1, hosts: [...], port: 2222}")
    if mode == "coordinator" and not have["chief"]:
        raise bad("chief", "mode coordinator needs a chief job (it runs the coordinator)",
                  hint="add chief: {count: 1, hosts: [...], port: ...}")
    if mode == "mirrored" and have["ps"]:
        raise bad("ps", "mode mirrored takes no ps tasks: MultiWorkerMirroredStrategy uses no "
                        "parameter servers", hint="remove the ps job or pick another train.mode")


def _check_jax(slots: tuple[Slot, ...], have: dict[str, int], bad) -> None:
    """Mode keras-jax: one JAX process per worker task, worker 0 the coordinator; no other job has
    a meaning there. A GPU host running two processes that each take all its GPUs would
    have them fight over the devices (_assign_gpus refuses that with the counts)."""
    for name in ("chief", "ps", "evaluator"):
        if have[name]:
            raise bad(name, f"mode keras-jax takes no {name} tasks: every JAX process is a worker and worker 0 "
                            f"runs the coordinator", hint=f"remove the {name} job or pick another train.mode")
    first = slots[0]
    odd = next((s for s in slots if len(s.gpus) != len(first.gpus)), None)
    if odd is not None:     # JAX's meshes assume one local device count (found: an AssertionError at start)
        raise bad("worker", f"{first.job}:{first.index} gets {len(first.gpus)} GPUs and {odd.job}:{odd.index} "
                            f"{len(odd.gpus)}: JAX needs the same number of devices in every process",
                  hint="give each task the same GPUs (jobs.worker.gpus), or one process per GPU (per_gpu: true)")

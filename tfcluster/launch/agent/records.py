"""What HostAgent hands back and sends: plain records, and the pure conversions between
them and the shim's JSON answers (shim_protocol.py, docs/ARCHITECTURE.md "The shim protocol")."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HostInfo:
    python_version: str
    tf_version: str | None
    machine_id: str
    gpus: int
    cuda_version: str | None = None     # what TF was built with; None for a CPU build
    cudnn_version: str | None = None
    driver_version: str | None = None   # the NVIDIA driver, when nvidia-smi answers
    tensorboard_version: str | None = None
    keras_version: str | None = None    # the `keras` package: Keras 3 is `tf.keras` from TF 2.16
    tf_keras_version: str | None = None  # Keras 2, used with TF_USE_LEGACY_KERAS=1; None: absent
    jax_version: str | None = None      # mode keras-jax: equal on every host, with jaxlib's
    jaxlib_version: str | None = None
    jax_cuda_version: str | None = None   # jax's CUDA plugin; None: jax here runs on the CPU only
    proxy: tuple[tuple[str, str], ...] = ()   # the proxy variables tasks inherit (shim_net)
    # with jax installed: (hostname, the address it resolves to there, or None); gloo advertises it
    hostname_address: tuple[str, str | None] | None = None


@dataclass(frozen=True)
class TaskLaunch:
    """One process to start: every name in it comes from tfcluster.names."""

    tag: str
    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str
    log: str
    pidfile: str
    no_proxy: tuple[str, ...] = ()      # kept off any proxy the host's environment sets
    # its TMPDIR the run directory (private): TensorBoard's info files, which it writes into a
    # shared /tmp directory it makes world-writable, following a link planted there
    private_tmp: bool = False


@dataclass(frozen=True)
class TaskStatus:
    tag: str
    pid: int
    alive: bool
    uptime_s: float | None
    log: str
    warm: bool = False          # started by `up` and waiting for GO: not a server yet
    unrecorded: bool = False    # found by its tag alone: no pid file names it
    port: int | None = None     # the port its pid file says it was started for


@dataclass(frozen=True)
class StopReport:
    stopped: tuple[tuple[str, int], ...]
    survivors: tuple[tuple[str, int], ...]
    busy: tuple[tuple[int, str], ...] = ()    # `down`: (port, holder) still not bindable


@dataclass(frozen=True)
class Survey:
    statuses: tuple[TaskStatus, ...]
    ports: dict[int, str | None]       # port -> None when free, else its holder


def host_info(info: dict) -> HostInfo:
    """The `info` answer as a HostInfo."""
    return HostInfo(python_version=info["python_version"], tf_version=info.get("tf_version"),
                    machine_id=info["machine_id"], gpus=int(info.get("gpus") or 0),   # light: neither
                    **{k: info.get(k) for k in ("cuda_version", "cudnn_version", "driver_version")},
                    **{k: info.get(k) for k in ("tensorboard_version", "keras_version", "tf_keras_version",
                                                   "jax_version", "jaxlib_version", "jax_cuda_version")},
                    proxy=tuple(sorted((info.get("proxy") or {}).items())),
                    hostname_address=tuple(info["hostname_address"]) if info.get("hostname_address") else None)


def ports_of(answer: dict) -> dict[int, str | None]:
    return {int(p): holder for p, holder in answer.items()}


def statuses_of(answer: list) -> list[TaskStatus]:
    return [TaskStatus(tag=s["tag"], pid=int(s["pid"]), alive=bool(s["alive"]),
                       uptime_s=s.get("uptime_s"), log=s.get("log") or "", warm=bool(s.get("warm")),
                       unrecorded=bool(s.get("unrecorded")),
                       port=s["port"] if type(s.get("port")) is int else None)
            for s in answer]


def stop_report(answer: dict) -> StopReport:
    """A `stop` answer, or `down`'s (with `ports`: port -> holder, None once bindable)."""
    return StopReport(stopped=tuple((s["tag"], int(s["pid"])) for s in answer["stopped"]),
                      survivors=tuple((s["tag"], int(s["pid"])) for s in answer["survivors"]),
                      busy=tuple((int(p), holder) for p, holder in (answer.get("ports") or {}).items() if holder))


def event_of(answer: dict) -> tuple[str, str, object]:
    """A line of `launch`, `wait` or `up`'s GO as (key, "started", pid), or (key, state,
    holder) once that server is decided."""
    if "pid" in answer:
        return answer["key"], "started", int(answer["pid"])
    return answer["key"], answer["state"], answer.get("holder")


def start_request(t: TaskLaunch, cluster_dir: str, port: int | None = None) -> dict:
    """The host adds the identity of `cluster_dir` to the tag (docs/ARCHITECTURE.md, "Naming").
    A server's `port` goes into its pid file: `status` tells when the spec moved it since."""
    request = {"tag": t.tag, "argv": list(t.argv), "env": dict(t.env), "cwd": t.cwd, "log": t.log,
               "pidfile": t.pidfile, "no_proxy": list(t.no_proxy), "cluster_dir": cluster_dir}
    if t.private_tmp:
        request["private_tmp"] = True
    return request if port is None else dict(request, port=port)

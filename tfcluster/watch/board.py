"""TensorBoard on the chief's host for the length of a run (`train.tensorboard`, `--tensorboard`).

It is an attached process of the run with the role `tensorboard` in its tag, so it dies
with the run like the run's servers (its shim's watchdog, and the run's stop sweep by tag
prefix). A remote host's port is forwarded through the SSH connection already open. The
URL is printed once TensorBoard answers, from a thread: training never waits for it.
TensorBoard is optional: nothing here fails a run, a problem is one warning line.
(Not `tensorboard.py`: this directory is first on sys.path for a local host's shim and TF
server, and TensorFlow may import the real `tensorboard`.) See docs/design/tensorboard.md,
"TensorBoard on the chief".
"""
from __future__ import annotations

import collections
import os
import threading
import time

from tfcluster.errors import Terminated
from tfcluster.plan import Plan, TaskPlan, names

PORTS = range(6006, 6026)       # TensorBoard's own default, and upward
READY_TIMEOUT = 60.0            # warn when it has not answered by then (and keep waiting)
POLL = 0.25                     # between two readiness probes
PROBE_TIMEOUT = 5.0             # one readiness probe
STOP_GRACE = 2.0                # TensorBoard holds nothing worth waiting for
LOG_NAME = names.log_name("", names.TENSORBOARD)


def command(python: str, logdir: str, port: int) -> tuple[str, ...]:
    """What runs on the chief's host; a leading `~/` of the logdir is expanded there."""
    return (python, "-m", "tensorboard.main", "--logdir", logdir, "--port", str(port),
            "--host", "127.0.0.1")


def host_task(plan: Plan) -> TaskPlan:
    """The task TensorBoard runs beside: the chief (else the first task that runs the script)."""
    return plan.chief or next(t for t in plan.tasks if t.runs_script)


def start(session, plan: Plan, run_id: str, ui, save_dir: str, heartbeat: float) -> "Board | None":
    """Start TensorBoard for this run; None (after one warning line) when it cannot run."""
    task = host_task(plan)
    host = plan.host(task.host)
    info = session.infos.get(task.host)
    if info is not None and not info.tensorboard_version:
        ui.warn(f"TensorBoard is not installed for {host.python} on {task.host}; training without "
                f"it (`{host.python} -m pip install tensorboard` there adds it)")
        return None
    agent = session.agents[task.host]
    try:
        taken = {t.port for t in plan.tasks_on(task.host)}
        candidates = [p for p in PORTS if p not in taken]
        free = [p for p, holder in agent.check_ports(candidates).items() if holder is None]
        if not free:
            ui.warn(f"TensorBoard not started: ports {PORTS[0]}-{PORTS[-1]} are all taken on "
                    f"{task.host}; training goes on")
            return None
        port = min(free)
        # TMPDIR private: TensorBoard writes /tmp/.tensorboard-info/pid-N.info, in a directory
        # it makes 0777 without the sticky bit, following a link another user planted there
        launch = session.launch_for(task, run_id, names.TENSORBOARD,
                                    command(host.python, plan.tensorboard, port),
                                    {"CUDA_VISIBLE_DEVICES": ""}, private_tmp=True)
        handle = agent.start_attached(launch, heartbeat_timeout=heartbeat, grace=STOP_GRACE)
    except (KeyboardInterrupt, Terminated):
        raise                   # the run's stop sweep stops whatever was started
    except Exception as exc:  # noqa: BLE001 - TensorBoard must never fail a run
        ui.warn(f"TensorBoard not started on {task.host}: {exc}; training goes on")
        return None
    return Board(ui, task.host, plan.tensorboard, port, handle, agent,
                 os.path.join(save_dir, LOG_NAME))


class Board:
    """A started TensorBoard: its output saved, its URL announced once it answers.

    The URL is announced only once the socket listening on the port is TensorBoard's (the
    process its shim started, or a descendant: the host agent's wait_ready, as for a server),
    so another user's server that took the port first is never vouched for. Then it is probed
    through the transport (a direct-tcpip channel for a remote host), and only then is the
    local port opened: on a "remote" host that is this machine, a listener opened earlier
    could take the very port TensorBoard is about to bind."""

    def __init__(self, ui, host: str, logdir: str, port: int, handle, agent, log_path: str) -> None:
        self.ui, self.host, self.logdir, self.port = ui, host, logdir, port
        self.handle, self.agent, self.transport, self.log_path = handle, agent, agent.transport, log_path
        self.url: str | None = None
        self.forward = None
        self._lock = threading.Lock()
        self.closing = threading.Event()
        self.exited = threading.Event()
        self.tail: collections.deque[str] = collections.deque(maxlen=3)
        self._threads = [threading.Thread(target=self._save_output, name="tfcluster-tb-log", daemon=True),
                         threading.Thread(target=self._announce, name="tfcluster-tb-wait", daemon=True)]
        for thread in self._threads:
            thread.start()

    def _save_output(self) -> None:
        """TensorBoard's output goes to runs/<run id>/tensorboard.log, never the live view."""
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        partial = b""
        try:
            while chunk := self.handle.read():
                os.write(fd, chunk)
                *lines, partial = (partial + chunk).split(b"\n")
                self.tail.extend(x.decode(errors="replace").strip() for x in lines if x.strip())
                partial = partial[-4096:]
            rc = self.handle.wait(30)
        except Exception:  # noqa: BLE001 - a lost channel: its shim stops TensorBoard
            rc = None
        finally:
            os.close(fd)
            self.exited.set()
        if not self.closing.is_set():
            last = f": {self.tail[-1]}" if self.tail else ""
            self.ui.warn(f"TensorBoard on {self.host} exited with code {rc}{last}; training goes on "
                         f"(log: {self.log_path})")

    def _announce(self) -> None:
        if not self._listening():
            return
        deadline = time.monotonic() + READY_TIMEOUT
        warned = False
        while not self.closing.is_set() and not self.exited.is_set():
            if answers(self.transport, self.port):
                self._forward()
                return
            if not warned and time.monotonic() > deadline:
                warned = True
                self.ui.warn(f"TensorBoard on {self.host} has not answered within "
                             f"{READY_TIMEOUT:.0f}s; still waiting (log: {self.log_path})")
            self.closing.wait(POLL)

    def _listening(self) -> bool:
        """Whether TensorBoard itself listens on its port (waiting while it starts); a holder
        that is not TensorBoard is said once, and no URL follows."""
        warned = False
        while not self.closing.is_set() and not self.exited.is_set():
            try:
                [(_key, state, holder)] = self.agent.wait_ready([("tensorboard", self.port, self.handle.pid)],
                                                                READY_TIMEOUT)
            except Exception:  # noqa: BLE001 - the connection went: the run's own checks say so
                return False
            if state == "ready":
                return True
            if state == "taken" and not self.closing.is_set():
                self.ui.warn(f"TensorBoard on {self.host}: port {self.port} is held by {holder}, not by "
                             f"the TensorBoard tfcluster started; no URL shown, training goes on")
            if state != "timeout":
                return False        # taken, or exited (_save_output says how)
            if not warned and not self.closing.is_set():
                warned = True
                self.ui.warn(f"TensorBoard on {self.host} has not opened port {self.port} within "
                             f"{READY_TIMEOUT:.0f}s; still waiting (log: {self.log_path})")
        return False

    def _forward(self) -> None:
        try:
            forward = self.transport.forward(self.port, local_port=self.port)
        except Exception as exc:  # noqa: BLE001 - no local port: TensorBoard only
            self.ui.warn(f"TensorBoard on {self.host} runs, but no local port forwards to it: {exc}")
            return
        with self._lock:
            if self.closing.is_set():
                forward.close()
                return
            self.forward = forward
        self.url = f"http://127.0.0.1:{forward.local_port}/"
        self.ui.info(f"TensorBoard: {self.url} (logdir {self.logdir} on {self.host})")

    def close(self) -> None:
        """Stop forwarding and ask TensorBoard to stop (the run's stop sweep makes sure)."""
        with self._lock:
            self.closing.set()
            forward = self.forward
        if forward is not None:
            _quietly(forward.close)
        _quietly(self.handle.stop)
        self._threads[1].join(PROBE_TIMEOUT + 1)

    def wait_stopped(self) -> None:
        """After close(): until TensorBoard's shim exits, which it does once it has reaped
        TensorBoard (TERM, STOP_GRACE, KILL). The run's stop sweep alone can miss a
        TensorBoard that is still exiting: its tag is unreadable by then."""
        self.exited.wait(STOP_GRACE + 5)


def answers(transport, port: int) -> bool:
    """Whether TensorBoard answers GET / with 200 at 127.0.0.1:`port` on the host (one
    connection through the transport; never a proxy)."""
    try:
        stream = transport.tunnel(port)
    except Exception:  # noqa: BLE001 - nothing listens yet (refused), or the connection is gone
        return False
    try:
        stream.settimeout(PROBE_TIMEOUT)
        stream.sendall(b"GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        head = b""
        while b"\r\n" not in head and len(head) < 4096:
            chunk = stream.recv(4096)
            if not chunk:
                break
            head += chunk
        return head.split(b"\r\n", 1)[0].split(b" ")[1:2] == [b"200"]
    except Exception:  # noqa: BLE001 - reset, timeout, closed channel: not (yet) answering
        return False
    finally:
        _quietly(stream.close)


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - stopping is best effort; the stop sweep follows
        pass

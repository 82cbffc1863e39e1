"""A warm standby on a host: a held start (held.py) whose shim keeps a script's interpreter
with TensorFlow imported (host/shim_warm.py, host/shim_standby.py) until take() hands it a
task. The shim answers the take's handshake either way: `warm` true when the standby became
the task (the same pid), false with `why` when it started the task cold instead."""
from __future__ import annotations

from typing import TYPE_CHECKING

from tfcluster.launch.agent.attached import AttachedTask, handshake
from tfcluster.launch.agent.held import HeldStart
from tfcluster.launch.agent.records import TaskLaunch, start_request
from tfcluster.host import shim_protocol as proto

if TYPE_CHECKING:
    from tfcluster.launch.agent.agent import HostAgent


class Standby(HeldStart):
    """`launch`: the standby's own (its standby tag, log and pid file; the interpreter and the
    environment of a task it may take)."""

    def __init__(self, agent: HostAgent, launch: TaskLaunch, heartbeat_timeout: float, grace: float) -> None:
        self._grace = grace
        super().__init__(agent, launch, heartbeat_timeout, grace, extra={"standby": True})

    def take(self, launch: TaskLaunch, restart: dict | None = None) -> tuple[AttachedTask, dict]:
        """The task `launch` on this standby (or cold, its shim says which): its attached
        task and the handshake."""
        where = f"host {self.agent.name}: {launch.tag}"
        request = {**start_request(launch, self.agent.paths.root), "attached": True,
                   "heartbeat_timeout": self._timeout, "grace": self._grace,
                   "deflate": self.agent.transport.deflate_logs}
        if restart:
            request["restart"] = restart
        try:
            self.agent.check_cancelled()
            self.proc.write(proto.json_line({"take": request}))
            said, err = handshake(self.proc, where)
            self.task.started(said, err)
        except BaseException:
            self.drop()
            raise
        finally:
            self._holding = False
        return self.task, said

    def alive(self) -> bool:
        """Its shim's channel is still open (a dead shim: no standby to take)."""
        return self.proc is not None and self.proc.wait(0) is None

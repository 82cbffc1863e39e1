"""Which of a session's hosts can hold tasks now: the one owner of that answer.

A host stops being usable in one of four ways, and each is recorded here, once, by whoever
finds it, with the reason said to the user:
- **set aside**: a spare that could not be opened, failed a check, cannot close the task
  ports under `tf_ports: closed`, or was found dead when a move needed it;
- **down at the start**: a host with tasks whose sshd did not answer when `up` or `train`
  began (deadhosts.py put its tasks on a spare);
- **lost** during a run: HostLosses' verdict (hostloss.py), which this pool holds;
- **given up** by a run: lost or drained, its tasks moved off it (run/recovery.py); a drain
  that found no spare takes it back;
- **warned**: a notice says it goes at a deadline (run/notices.py); a withdrawn one clears it.

`spare_for` asks the plan for a spare among the hosts none of these rules out. Nothing else
keeps a set of unusable hosts.
"""
from __future__ import annotations

import time

from tfcluster.launch.cluster.hostloss import HostLosses, LostHost


class HostPool:
    def __init__(self, losses: HostLosses | None = None) -> None:
        self.losses = losses or HostLosses()
        self.aside: dict[str, str] = {}      # host -> why it cannot take tasks
        self.given_up: set[str] = set()      # hosts a run gave up (lost or drained)
        self.warned: dict[str, float] = {}   # host -> when a notice says it goes (time.time())

    @property
    def lost(self) -> dict[str, LostHost]:
        return self.losses.lost

    def set_aside(self, host: str, why: str) -> None:
        self.aside.setdefault(host, why)

    def give_up(self, host: str) -> None:
        self.given_up.add(host)

    def take_back(self, host: str) -> None:
        """A drain that found no spare: the host still runs its tasks."""
        self.given_up.discard(host)

    def warn(self, host: str, deadline: float) -> None:
        """A notice says `host` goes at `deadline` (run/notices.py): no task moves there."""
        self.warned[host] = min(deadline, self.warned.get(host, deadline))

    def unwarn(self, host: str) -> None:
        """Its notice was withdrawn (a false alarm)."""
        self.warned.pop(host, None)

    def gone_by_now(self, host: str) -> bool:
        """Its notice's deadline passed: nothing is asked of it any more (a stop would wait
        out a connection to a host that was taken back)."""
        return host in self.warned and time.time() >= self.warned[host]

    def usable(self, host: str) -> bool:
        """Its tasks can be asked things (a warned host's are, until they move)."""
        return host not in self.aside and host not in self.lost and host not in self.given_up

    def unusable(self) -> set[str]:
        """The hosts no task may move to (a warned one included)."""
        return set(self.aside) | set(self.lost) | self.given_up | set(self.warned)

    def pending(self) -> LostHost | None:
        """The first host lost and not yet given up by the run."""
        fresh = [v for h, v in self.lost.items() if h not in self.given_up]
        return min(fresh, key=lambda v: v.at, default=None)

    def spare_for(self, plan, host: str) -> str | None:
        """A spare for `host`'s tasks that nothing rules out (Plan.spare_for: GPUs, ports)."""
        return plan.spare_for(host, used=self.unusable())

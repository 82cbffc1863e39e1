"""The checks that watch a running `train`: placement consistency (TF1 modes), the strategy
against the mode (TF2 modes) and the hang watchdog.

`RunChecks` is what the supervisor holds: the LogMux hands it every line that carries a
marker (from any pump thread), and the supervisor's loop calls `tick` twice a second.
A placement or strategy mismatch ends the run (InconsistentError, exit 8); a wait only ever gets a
diagnosis, printed at a bounded rate. Facts about the awaited task are gathered off the
supervisor's loop (a port check over SSH may take a second). docs/design/diagnoses.md,
"Diagnoses", says what each check costs and cannot see.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Callable

from tfcluster.diagnose import placement as pl
from tfcluster.diagnose import strategy as st
from tfcluster.diagnose import watchdog as wd
from tfcluster.errors import InconsistentError
from tfcluster.host import shim_net
from tfcluster.plan import Plan
from tfcluster.plan.names import log_file

PORT_CHECK_TIMEOUT = 3.0
# seconds a strategy mismatch waits before it ends the run: a script that reported one often
# fails on its own a moment later (keras-io's `jax.devices("gpu")` on a CPU host starts JAX's
# backend, so reports it never joined, and then raises), and its own error is the one to fix first
MISMATCH_GRACE = 3.0
# (from_host, [(address, port)], timeout) -> {"address:port": None | why not}
Connect = Callable[[str, list, float], dict]


class RunChecks:
    def __init__(self, plan: Plan, ui, log_dir: str, wake: Callable[[], None],
                 connect: Connect | None = None) -> None:
        """`connect` probes from a remote host (the launcher's reach check, which this side
        of the system may not import); without it a remote host's ports go unchecked."""
        self.plan, self.ui, self.log_dir, self.wake, self.connect = plan, ui, log_dir, wake, connect
        probes = plan.probes().split(",")
        scripts = [t.key for t in plan.tasks if t.runs_script and t.job in ("chief", "worker")]
        self.placement = pl.PlacementCheck(scripts) if "placement" in probes else None
        # TF2 modes: the strategy each script builds, against the mode (switched with placement)
        judged = st.judged_tasks(plan) if plan.checks.placement else []
        self.strategy = st.StrategyCheck(plan.mode, judged, len(scripts)) if judged else None
        chief = plan.chief
        self.jax = plan.mode == "keras-jax"
        self.watchdog = wd.Watchdog(plan.checks.hang_after, targets={t.target: t.key for t in plan.tasks},
                                    chief=chief.key if chief else None,
                                    coordinator=scripts[0] if self.jax and scripts else None) \
            if plan.checks.hang_after > 0 else None
        self._keys = {t.key for t in plan.tasks}
        self._diagnosing = threading.Lock()
        self._starts: dict[tuple[str, float], float] = {}   # (task, attempt's wall start): monotonic
        self._mismatch_at: float | None = None     # when a strategy mismatch was first seen
        self.diagnoses = 0
        self.said: dict[str, int] = {}      # "worker:1 silent", "worker:0 waited for ps:0" -> times said

    def adopt(self, plan: Plan) -> None:
        """The plan after a move: the watchdog names, and dials, the hosts the tasks run on now."""
        self.plan = plan
        if self.watchdog is not None:
            self.watchdog.targets = {t.target: t.key for t in plan.tasks}

    @property
    def markers(self) -> tuple[bytes, ...]:
        marks: tuple[bytes, ...] = ()
        if self.placement is not None:
            marks += (pl.MARK,)
        if self.strategy is not None:
            marks += (st.MARK,)
        if self.watchdog is not None:
            marks += wd.MARKERS + (wd.JAX_MARKERS if self.jax else ())
        return marks

    def on_line(self, key: str, line: bytes) -> None:
        """LogMux's watch callback (a pump thread, under that task's lock: be quick)."""
        if self.placement is not None and pl.MARK in line and "." not in key:
            report = pl.parse(line)
            if report is not None and self.placement.add(report) is not None:
                self.wake()
            return
        if self.strategy is not None and st.MARK in line and "." not in key:
            report = st.parse(line)
            if report is not None and self.strategy.add(report) is not None:
                self.wake()
            return
        if self.watchdog is not None:
            self.watchdog.saw(key, line, time.monotonic())

    def verdict(self) -> None:
        """Raise when the workers cannot have trained together: a placement or strategy
        mismatch (also asked once the scripts ended well: a script that built no strategy
        says so as it exits)."""
        if self.placement is not None and self.placement.mismatch is not None:
            raise InconsistentError(self.placement.mismatch.message(), hint=pl.FIX)
        if self.strategy is not None and self.strategy.mismatch is not None:
            message, hint = self.strategy.mismatch
            raise InconsistentError(message, hint=hint)

    def pending(self) -> tuple[str, str] | None:
        """A strategy mismatch seen and not yet raised (its grace runs): (message, hint)."""
        return self.strategy.mismatch if self.strategy is not None else None

    def tick(self, procs, mux) -> None:
        """Raise on a placement mismatch, or a strategy mismatch once its grace is over; start a
        diagnosis of any wait that is due."""
        now = time.monotonic()
        if self.pending() is not None and self._mismatch_at is None:
            self._mismatch_at = now
        if self._mismatch_at is None or now - self._mismatch_at >= MISMATCH_GRACE:
            self.verdict()
        elif self.placement is not None and self.placement.mismatch is not None:
            raise InconsistentError(self.placement.mismatch.message(), hint=pl.FIX)
        if self.watchdog is None:
            return
        running = {p.task.key for p in procs if p.role == "script" and p.exit_code is None and p.handle}
        scripts = [p for p in procs if p.role == "script" and p.task.key in running and p.task.job != "ps"]
        # JAX processes advance together: one that prints nothing (the template's processes
        # other than 0) is not silent while another prints
        latest = max((mux.last_output(p.key) or 0.0 for p in scripts), default=0.0) if self.jax else 0.0
        for p in scripts:     # a ps that runs the script (classic mode) serves silently: normal
            # the attempt's start on the monotonic clock, reckoned once: reckoned again each tick
            # it moved by the two clocks' read apart, and a task that never printed looked like
            # a new silence every tick (its warning then came twice a second, not once a minute)
            started = self._starts.setdefault((p.key, p.attempt_started),
                                              now - max(0.0, time.time() - p.attempt_started))
            since = max(mux.last_output(p.key) or started, latest)
            self.watchdog.silent(p.task.key, since, now, started)
        due = self.watchdog.due(now, running)
        if due and self._diagnosing.acquire(blocking=False):
            threading.Thread(target=self._diagnose, args=(due, list(procs), mux), daemon=True,
                             name="diagnose").start()

    def summary(self) -> dict[str, str]:
        out = {}
        if self.plan.mode in ("between-graph", "classic"):     # the modes the probe serves
            out["placement"] = self.placement.summary() if self.placement is not None else "off"
        if self.strategy is not None:
            out["strategy"] = self.strategy.summary()
        if self.watchdog is not None:
            # what the watchdog can see: TF's session waits (a hang elsewhere is not one)
            quiet = ("no process silent past JAX's timeouts" if self.jax
                     else f"no session wait over {self.plan.checks.hang_after:g}s")
            shown = ", ".join(f"{what}{f' ({n}×)' if n > 1 else ''}" for what, n in self.said.items())
            out["hang"] = f"{self.diagnoses} diagnosis(es)" + (f": {shown}" if shown else "") if self.diagnoses else quiet
        return out

    # -- facts -------------------------------------------------------------------------

    def _diagnose(self, due: list[wd.Wait], procs, mux) -> None:
        try:
            for wait in due:
                if wait.target is not None and wait.target not in self._keys:
                    wait.target = None          # TF named a task of another cluster: no facts
                facts = self._facts(wait, procs, mux) if wait.target else self._proxy_only(wait)
                host = self.plan.task(wait.waiter).host
                hint = os.path.join(self.log_dir, log_file(self._log_key(wait.target or wait.waiter)))
                self.ui.warn(wd.explain(wait, facts, time.monotonic(), host, hint))
                self.diagnoses += 1
                what = f"{wait.waiter} {'silent' if wait.kind == 'silent' else 'waited'}" + (
                    f" for {wait.target}" if wait.target and wait.kind != "silent" else "")
                self.said[what] = self.said.get(what, 0) + 1
        except Exception as exc:  # noqa: BLE001 - a diagnosis must never break the run
            self.ui.warn(f"hang watchdog: could not diagnose: {exc}")
        finally:
            self._diagnosing.release()

    def _log_key(self, key: str) -> str:
        """The log of task `key`: its server's where no script of it runs (a ps)."""
        task = self.plan.task(key)
        return f"{key}.server" if task.runs_server and not task.runs_script else key

    def port_check(self, from_host: str, address: str, port: int) -> str | None:
        """None when address:port accepts a connection from `from_host`, else why not (the
        reach check's own probe: here for a local host, through its shim for a remote one)."""
        if self.plan.host(from_host).local:
            return shim_net.probe(address, port, PORT_CHECK_TIMEOUT)
        if self.connect is None:
            return "unchecked"
        answer = self.connect(from_host, [(address, port)], PORT_CHECK_TIMEOUT)
        return answer.get(f"{address}:{port}", "unchecked")

    def _proxy_only(self, wait: wd.Wait) -> wd.Facts:
        return wd.Facts(proxy=self._proxy(wait.waiter))

    def _proxy(self, key: str) -> str | None:
        return ", ".join(shim_net.proxies_set(dict(self.plan.task(key).env))) or None

    def _facts(self, wait: wd.Wait, procs, mux) -> wd.Facts:
        target = self.plan.task(wait.target)
        role = "server" if target.runs_server else "script"
        proc = next((p for p in procs if p.task.key == target.key and p.role == role), None)
        if proc is None and role == "server":
            state, pid, code, key = "running", None, None, None      # a server from `tfcluster up`
        elif proc is None or proc.handle is None:
            state, pid, code, key = "not started", None, None, None
        else:
            key, code = proc.key, proc.exit_code
            pid = getattr(proc.handle, "pid", None)
            state = "running" if code is None else ("finished" if code == 0 else "failed")
        last = mux.last_output(key) if key else None
        port = None
        if state == "running":
            port = self.port_check(self.plan.task(wait.waiter).host, target.address, target.port)
        tail = mux.tail(key, 1) if key else []
        return wd.Facts(host=target.host, address=target.target, state=state, exit_code=code, pid=pid,
                        port=port, quiet_for=time.monotonic() - last if last else None,
                        last_line=tail[-1] if tail else "", proxy=self._proxy(wait.waiter))

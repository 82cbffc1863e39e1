"""The launcher `tfcluster render` puts into TFJob pods and Slurm jobs.

On every task of the other engine it gives the unchanged training script what
`tfcluster train` gives it: TF_CONFIG, the TFCLUSTER_* variables, a TF server for the
task in the modes that have one (the script is then its client, TFCLUSTER_MASTER), and
every line of output prefixed with `job:index │ `. Standard library only; it reads its
config (tfcluster-launch.json) from beside itself. docs/design/engines.md, "Other engines".

    python3 launch.py tfjob     in a TFJob pod (the operator wrote TF_CONFIG)
    python3 launch.py addrs     Slurm, on the batch node: every node's NodeAddr
    python3 launch.py ports     Slurm, step 1: this task's free TF and control ports
    python3 launch.py run       Slurm, step 2: this task, with the cluster from step 1
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
READY_TIMEOUT = 300.0     # seconds for a task's TF server to listen
NOTIFY_TIMEOUT = 30.0     # seconds a finished task tries to tell each ps it is done
STOP_GRACE = 10.0         # seconds between TERM and KILL for a task's children (train.stop_grace)
COORDINATOR = "{coordinator}"   # bundle.py's placeholder in a keras-jax process's variables
_out = threading.Lock()


class Failed(Exception):
    """A one-line reason; the task exits 2."""


def say(prefix: str, line: str) -> None:
    with _out:
        sys.stdout.write(prefix + line.rstrip("\n") + "\n")
        sys.stdout.flush()


def load_config() -> dict:
    with open(os.path.join(HERE, "tfcluster-launch.json"), encoding="utf-8") as f:
        return json.load(f)


def placeholders(cfg: dict, cluster: dict, job: str, index: int) -> dict[str, str]:
    """The values train.args may name, as `tfcluster plan` documents them, from the
    cluster the tasks really have here."""
    workdir = cfg["workdir"]
    if workdir == "~" or workdir.startswith("~/"):
        workdir = os.path.expanduser(workdir)
    values = {"job": job, "index": str(index), "workdir": workdir,
              "num_workers": str(len(cluster.get("worker", [])))}
    for name in ("chief", "ps", "worker"):
        values[f"{name}_hosts"] = ",".join(cluster.get(name, []))
    return values


def fill(args: list[str], values: dict[str, str]) -> list[str]:
    return [string.Formatter().vformat(a, (), values) for a in args]


def is_waiter(cfg: dict, job: str) -> bool:
    """A task that serves until the others are done (a ps; a coordinator's workers)."""
    return job == "ps" or (cfg["mode"] == "coordinator" and job == "worker")


# -- processes ----------------------------------------------------------------------------

def start(argv: list[str], env: dict, cwd: str, prefix: str) -> subprocess.Popen:
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    thread = threading.Thread(target=_pump, args=(proc, prefix), daemon=True)
    thread.start()
    proc.pump = thread      # joined before the task says it ended, so no line is lost
    return proc


def _pump(proc: subprocess.Popen, prefix: str) -> None:
    for raw in iter(proc.stdout.readline, b""):
        say(prefix, raw.decode("utf-8", "replace"))


def stop(procs, grace: float = STOP_GRACE) -> None:
    live = [p for p in procs if p is not None and p.poll() is None]
    for p in live:
        p.terminate()
    deadline = time.monotonic() + grace
    for p in live:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def wait_listening(host: str, port: int, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise Failed(f"its TF server exited with code {server.returncode} before listening")
        try:
            socket.create_connection((host, port), timeout=2).close()
            return
        except OSError:
            time.sleep(0.2)
    raise Failed(f"its TF server did not listen on {host}:{port} within {READY_TIMEOUT:.0f}s")


# -- one task -----------------------------------------------------------------------------

def task_env(cfg: dict, cluster: dict, job: str, index: int, gpus: str | None) -> dict:
    missing = [k for k in cfg["secret_env"] if k not in os.environ]
    if missing:
        raise Failed(f"secret env {', '.join(missing)} not set where the job runs "
                     "(tfcluster never writes secrets into a rendered job)")
    env = dict(os.environ)
    env.update(cfg["env"])
    key = f"{job}:{index}"
    env.update({
        "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": job, "index": index}},
                                sort_keys=True, separators=(",", ":")),
        "TFCLUSTER_CLUSTER": cfg["name"], "TFCLUSTER_JOB": job, "TFCLUSTER_TASK_INDEX": str(index),
        "TFCLUSTER_IS_CHIEF": "1" if key == cfg["chief"] else "0",
        "TFCLUSTER_NUM_WORKERS": str(len(cluster.get("worker", []))),
        "TFCLUSTER_RUN_ID": env.get("SLURM_JOB_ID") or env.get("TFCLUSTER_RUN_ID") or cfg["name"],
    })
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    return env


def run_task(cfg: dict, cluster: dict, job: str, index: int, address: str, port: int,
             env: dict, cwd: str, prefix: str, until_done=None) -> int:
    """Start the task's server and/or script; return the exit code the task ends with.
    `until_done`: for a waiter, a callable that returns once every other task is done."""
    server = script = None
    try:
        if job in cfg["server_jobs"]:
            target = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"    # IPv6 in brackets
            env = {**env, "TFCLUSTER_MASTER": f"grpc://{target}"}
            server = start([sys.executable, os.path.join(cwd, "tfserver.py")], env, cwd, prefix)
            wait_listening(address, port, server)
        if job in cfg["script_jobs"] and cfg["script"]:
            script_env = dict(env)
            if server is not None and cfg["mode"] == "between-graph":
                script_env["CUDA_VISIBLE_DEVICES"] = ""   # a client only: the server owns the GPU
            argv = [sys.executable, cfg["script"],
                    *fill(cfg["args"], placeholders(cfg, cluster, job, index))]
            script = start(argv, script_env, cwd, prefix)
        if until_done is not None:
            return until_done([p for p in (server, script) if p is not None])
        if script is not None:
            rc = script.wait()
            script.pump.join(5)
            return rc
        rc = server.wait() if server is not None else 0
        return rc
    except Failed as e:       # said as this task's, then its exit code (end) as any task's
        say(prefix, f"tfcluster: {e}")
        return 2
    finally:
        stop([script, server], float(cfg.get("stop_grace", STOP_GRACE)))
        for p in (script, server):
            if p is not None:
                p.pump.join(5)


# -- TFJob --------------------------------------------------------------------------------

def private_copy(cfg: dict) -> str:
    """The bundle in a private, writable directory (a ConfigMap mount is read-only)."""
    work = tempfile.mkdtemp(prefix="tfcluster-")
    for name in ["tfserver.py", *cfg["files"]]:
        dest = os.path.join(work, name)
        os.makedirs(os.path.dirname(dest), mode=0o700, exist_ok=True)
        shutil.copyfile(os.path.join(HERE, name), dest)
    return work


def tfjob(cfg: dict) -> int:
    try:
        config = json.loads(os.environ["TF_CONFIG"])
        cluster, job, index = config["cluster"], config["task"]["type"], int(config["task"]["index"])
    except (KeyError, ValueError, TypeError) as e:
        raise Failed(f"no usable TF_CONFIG from the training operator ({type(e).__name__}: {e})")
    key = f"{job}:{index}"
    if index >= len(cluster.get(job, [])):
        raise Failed(f"TF_CONFIG names task {key}, which its cluster does not have")
    port = cluster[job][index].rpartition(":")[2]
    # The operator lists the evaluator in every task's cluster; `train` never does.
    cluster = {j: cluster[j] for j in cfg["cluster_jobs"] if j in cluster}
    gpus = "" if job == "ps" else None        # elsewhere the device plugin chose the GPUs
    work = private_copy(cfg)
    try:
        env = task_env(cfg, cluster, job, index, gpus)
        # The pod's own name resolves to itself; its service name may not answer yet.
        return end(f"{key} │ ", run_task(cfg, cluster, job, index, "localhost", int(port), env,
                                          work, f"{key} │ "))
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- Slurm --------------------------------------------------------------------------------

def slurm_addrs() -> int:
    """One line: the NodeAddr of every node of the job, in SLURM_JOB_NODELIST order."""
    names = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                           check=True, capture_output=True, text=True).stdout.split()
    addrs = []
    for name in names:
        out = subprocess.run(["scontrol", "-o", "show", "node", name], capture_output=True,
                             text=True).stdout
        fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
        addrs.append(fields.get("NodeAddr") or name)
    print(" ".join(addrs))
    return 0


def my_slot(cfg: dict):
    """(job, index, gpus) of this Slurm task, or None for a slot the plan leaves idle."""
    node, local = int(os.environ["SLURM_NODEID"]), int(os.environ["SLURM_LOCALID"])
    hosts = cfg["hosts"]
    if node >= len(hosts) or local >= len(hosts[node]):
        return None
    job, index, gpus = hosts[node][local]
    return job, int(index), gpus


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def slurm_ports(cfg: dict) -> int:
    slot = my_slot(cfg)
    if slot is not None:
        print(f"tfcluster-port {slot[0]} {slot[1]} {os.environ['SLURM_NODEID']} {free_port()} "
              f"{free_port()}", flush=True)
    return 0


def slurm_cluster(cfg: dict) -> tuple[dict, dict]:
    """(TF cluster, key -> (address, port, control port)) from steps 1's report."""
    addrs = os.environ["TFCLUSTER_NODE_ADDRS"].split()
    where = {}
    for line in os.environ["TFCLUSTER_PORTS"].splitlines():
        parts = line.split()
        if len(parts) == 6 and parts[0] == "tfcluster-port":
            _, job, index, node, port, ctl = parts
            where[(job, int(index))] = (addrs[int(node)], int(port), int(ctl))
    expected = {(t[0], int(t[1])) for host in cfg["hosts"] for t in host}
    if set(where) != expected:
        lost = sorted(f"{j}:{i}" for j, i in expected - set(where))
        raise Failed(f"the port survey lost tasks {', '.join(lost)}")
    cluster: dict[str, list[str]] = {}
    for job in cfg["cluster_jobs"]:
        for (j, i) in sorted(k for k in where if k[0] == job):
            cluster.setdefault(job, []).append(f"{where[(j, i)][0]}:{where[(j, i)][1]}")
    return cluster, where


def visible_gpus(gpus: list[int]) -> str:
    """The task's GPUs among those Slurm gave the step (their numbering, not the node's)."""
    given = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
    if not given:
        return ",".join(map(str, gpus))
    return ",".join(given[g] for g in gpus if g < len(given))


def slurm_run(cfg: dict) -> int:
    slot = my_slot(cfg)
    if slot is None:
        return 0
    job, index, gpus = slot
    key = f"{job}:{index}"
    cluster, where = slurm_cluster(cfg)
    address, port, ctl = where[(job, index)]
    width = max(len(f"{j}:{i}") for j, i in where)
    prefix = f"{key:<{width}} │ "
    env = task_env(cfg, cluster, job, index, "" if job == "ps" else visible_gpus(gpus))
    # mode keras-jax: worker 0's surveyed address and port is the coordinator's
    env.update({k: cluster["worker"][0] if v == COORDINATOR else v
                for k, v in cfg.get("jax_env", {}).get(key, {}).items()})
    finishers = {f"{j}:{i}" for j, i in where if not is_waiter(cfg, j)}
    until = None
    if is_waiter(cfg, job):
        until = _waiter(ctl, finishers, os.environ.get("TFCLUSTER_TOKEN", ""), prefix)
    rc = run_task(cfg, cluster, job, index, address, port, env, os.getcwd(), prefix, until)
    if not is_waiter(cfg, job):
        _tell_waiters(cfg, where, key, os.environ.get("TFCLUSTER_TOKEN", ""))
    return end(prefix, rc)


def _waiter(ctl: int, finishers: set[str], token: str, prefix: str):
    """until_done for a ps: listen on the control port until every finisher said done."""
    listener = socket.create_server(("", ctl), reuse_port=False)

    def until_done(procs) -> int:
        done: set[str] = set()
        listener.settimeout(1.0)
        try:
            while not finishers <= done:
                for p in procs:
                    if p.poll() is not None:
                        return p.returncode or 1      # a ps must not end on its own
                try:
                    conn, _ = listener.accept()
                except socket.timeout:
                    continue
                with conn:
                    conn.settimeout(5)
                    try:
                        words = conn.recv(512).decode("ascii", "replace").split()
                    except OSError:
                        continue
                if len(words) == 2 and words[0] == token and words[1] in finishers:
                    done.add(words[1])
            say(prefix, "tfcluster: every worker is done; stopping")
            return 0
        finally:
            listener.close()
    return until_done


def _tell_waiters(cfg: dict, where: dict, key: str, token: str) -> None:
    for (job, index), (address, _port, ctl) in sorted(where.items()):
        if not is_waiter(cfg, job):
            continue
        deadline = time.monotonic() + NOTIFY_TIMEOUT
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((address, ctl), timeout=5) as s:
                    s.sendall(f"{token} {key}\n".encode())
                break
            except OSError:
                time.sleep(0.5)


def end(prefix: str, rc: int) -> int:
    say(prefix, f"tfcluster: exited with code {rc}")
    return rc


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # the engine stops the job
    # Slurm's --signal=USR1@N (a checkpoint request ahead of the time limit) reaches every
    # process of the step: ignored here, and so by the TF server, which inherits it across
    # exec; a script that honours the request installs its own handler, and one that does
    # not goes on instead of dying of it.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    command = argv[1] if len(argv) > 1 else ""
    commands = {"tfjob": tfjob, "ports": slurm_ports, "run": slurm_run}
    try:
        if command == "addrs":
            return slurm_addrs()
        if command not in commands:
            raise Failed(f"unknown command {command!r}; expected tfjob, addrs, ports or run")
        return commands[command](load_config())
    except Failed as e:
        say("", f"tfcluster: {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""`tfcluster up` over SSH on 4 loopback hosts vs the same servers started by hand with ssh(1).

One throwaway sshd listens on 127.0.0.2-5 (4 "hosts"); 1 ps (127.0.0.2) + 3 workers, each
task on its own port (TF servers bind *:PORT).
tfcluster: `python -m tfcluster up SPEC`, spawn to exit (every server accepts connections);
`down` after each rep, untimed.
Baseline: 4 OpenSSH `ssh -p P -i KEY -o UserKnownHostsFile=... HOST 'cd DIR && TF_CONFIG=...
setsid nohup PYTHON -c SERVER >log 2>&1 </dev/null &'` run in parallel, then ports polled
every 50 ms from here until all 4 accept; timed from the first ssh spawn. Killed after, untimed.

tfcluster's servers import TensorFlow lean (server_lib only: docs/design/remote-execs.md, "The servers'
import"); `--server-import full` gives them the full `import tensorflow` the baseline does, so
the ratio is the orchestration alone.

    python benchmarks/up_ssh.py [--reps 3] [--server-import lean|full] [--smoke]
"""
from __future__ import annotations

import shlex
import subprocess
import sys
import time

from _common import (
    SERVER_PROGRAM,
    Bench,
    alternate,
    cluster_tasks,
    free_ports,
    loopback,
    parser,
    print_phases,
    report,
    tf_config,
    up_down,
    wait_ports,
    wait_ports_free,
    write_spec,
)

TARGET = 1.0


def main(argv=None) -> int:
    p = parser(__doc__, reps=3)
    p.add_argument("--server-import", choices=("lean", "full"), default="lean",
                   help="tfcluster's servers: lean import (the default) or the full `import tensorflow`")
    a = p.parse_args(argv)
    reps = 1 if a.smoke else a.reps
    with Bench("up_ssh") as b:
        addrs = loopback(2 if a.smoke else 4)   # smoke: 1 ps + 1 worker
        sshd = b.start_sshd(addrs)
        ports = free_ports(len(addrs))
        hosts = [(f"h{a.split('.')[-1]}", a) for a in addrs]
        jobs = {"ps": [f"{hosts[0][0]}:{ports[0]}"],
                "worker": [f"{h}:{p}" for (h, _), p in zip(hosts[1:], ports[1:])]}
        cluster = {"ps": [f"{addrs[0]}:{ports[0]}"],
                   "worker": [f"{ad}:{p}" for ad, p in zip(addrs[1:], ports[1:])]}
        remote = b.tmp / "remote"
        hand_dir = b.tmp / "hand"
        hand_dir.mkdir()
        spec = write_spec(b.tmp / "ssh.yaml", name="benchssh", hosts=hosts, jobs=jobs,
                          ssh_port=sshd.port, workdir=remote,
                          env={"TFCLUSTER_SERVER_IMPORT": "full"} if a.server_import == "full" else None)
        downs, phases = [], []

        def hand() -> float:
            cmds = []
            for (job, i, target), addr in zip(cluster_tasks(cluster), addrs):
                env = {"TF_CONFIG": tf_config(cluster, job, i), "TF_CPP_MIN_LOG_LEVEL": "2",
                       "CUDA_VISIBLE_DEVICES": "", "TFCLUSTER_JOB_ID": f"bench-hand:{job}:{i}"}
                assign = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
                cmd = (f"cd {shlex.quote(str(hand_dir))} || exit 1; {assign} setsid nohup {shlex.quote(sys.executable)} "
                       f"-c {shlex.quote(SERVER_PROGRAM)} >{job}{i}.log 2>&1 </dev/null &")
                cmds.append(sshd.ssh(addr, cmd))
            t = time.perf_counter()
            procs = [subprocess.Popen(c, env=b.env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE) for c in cmds]
            for p in procs:
                if p.wait(60):
                    raise RuntimeError(f"ssh failed: {p.stderr.read().decode()[-1000:]}")
            wait_ports(list(zip(addrs, ports)), timeout=120)
            dt = time.perf_counter() - t
            b.kill_tagged()
            wait_ports_free(ports)
            return dt

        def tfc() -> float:
            up_s, down_s = up_down(b, spec, phases=phases)
            downs.append(down_s)
            wait_ports_free(ports)
            return up_s

        print(f"up_ssh: 1 ps + {len(addrs) - 1} workers on {len(addrs)} loopback hosts over SSH (sshd port {sshd.port}), {reps} reps",
              flush=True)
        ra, rb = alternate(reps, hand, tfc)
        print(f"  (untimed) tfcluster down took median {sorted(downs)[len(downs) // 2]:.2f} s")
        print_phases(phases)
        report(f"up_ssh ({len(addrs)} hosts, 1 ps + {len(addrs) - 1} workers)", f"{len(addrs)}x parallel ssh 'setsid nohup ...' + poll", ra,
               f"tfcluster up ({a.server_import} import)", rb, "s", TARGET)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`tfcluster exec SPEC -- true` vs `pdsh -R ssh -f 64 -w 127.0.0.[2-N] true`, on 8, 32, 64 hosts.

One throwaway sshd listens on 64 loopback addresses 127.0.0.2 ... 127.0.0.65 (MaxStartups
200:30:300, MaxSessions 64). Both sides use the same user key and known_hosts (strict host-key
checking) from an isolated HOME; pdsh gets them through PDSH_SSH_ARGS_APPEND and fans out 64
at once (`-f 64`; its default is 32). Wall time of the whole command, spawn to exit, output to
/dev/null; reps alternate which side runs first.

    python benchmarks/exec_fanout.py [--reps 5] [--sizes 8,32,64] [--smoke]
"""
from __future__ import annotations

import subprocess
import sys
import time

from _common import TFCLUSTER, Bench, alternate, loopback, parser, report, write_spec

TARGET = 1.0   # at 64 hosts


def main(argv=None) -> int:
    p = parser(__doc__, reps=5)
    p.add_argument("--sizes", default="8,32,64")
    a = p.parse_args(argv)
    sizes = [4] if a.smoke else [int(x) for x in a.sizes.split(",")]
    reps = 1 if a.smoke else a.reps
    with Bench("exec") as b:
        addrs = loopback(max(sizes))
        sshd = b.start_sshd(addrs)
        pdsh_env = b.env(PDSH_SSH_ARGS_APPEND=" ".join(sshd.ssh_options()), PDSH_RCMD_TYPE="ssh")
        met = {}
        for n in sizes:
            hosts = [(f"h{i + 2}", ad) for i, ad in enumerate(addrs[:n])]
            spec = write_spec(b.tmp / f"exec{n}.yaml", name=f"exec{n}", hosts=hosts,
                              jobs={"ps": [f"{hosts[0][0]}:19999"],
                                    "worker": [f"{h}:{20000 + i}" for i, (h, _) in enumerate(hosts)]},
                              ssh_port=sshd.port, workdir=b.tmp / "remote")
            last = addrs[n - 1].rsplit(".", 1)[1]
            pdsh = ["pdsh", "-R", "ssh", "-f", "64", "-S", "-w", f"127.0.0.[2-{last}]", "true"]
            tfc = TFCLUSTER + ["exec", str(spec), "--", "true"]

            def timer(argv, env):
                def go() -> float:
                    t = time.perf_counter()
                    r = subprocess.run(argv, env=env, cwd=b.cwd, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.PIPE, timeout=300)
                    dt = time.perf_counter() - t
                    if r.returncode:
                        raise RuntimeError(f"{argv[:3]} exited {r.returncode}: {r.stderr.decode()[-2000:]}")
                    return dt
                return go

            timer(pdsh, pdsh_env)()            # warm-up, untimed (page cache, .pyc)
            timer(tfc, b.env())()
            print(f"exec_fanout: {n} hosts, {reps} reps", flush=True)
            ra, rb = alternate(reps, timer(pdsh, pdsh_env), timer(tfc, b.env()))
            met[n] = report(f"exec_fanout ({n} hosts)", f"pdsh -R ssh -f 64 -w 127.0.0.[2-{last}] true", ra,
                            "tfcluster exec SPEC -- true", rb, "s", TARGET)
    return 0


if __name__ == "__main__":
    sys.exit(main())

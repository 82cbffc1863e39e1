"""What a checkpoint sync costs: the chief's newest checkpoint copied to the launcher, and back
to a fresh host (docs/design/checkpoint-sync.md).

One throwaway sshd on a loopback address holds a TensorFlow checkpoint of about 50 MB
(CheckpointManager, one variable of 12.5 M floats; `--mb` sets it). The launcher side is
tfcluster's CheckpointSync in this process, on a Session already open, as `train` runs it.

  * pull: CheckpointSync.pull, the newest complete checkpoint into a fresh run directory
    (found, streamed as the shim's header and raw bytes, written under a temporary name and
    renamed). Baseline: scp(1) of the same files into a directory, a person's copy by hand
    (its own connection each time: ssh's handshake is in its number).
  * push: CheckpointSync.push, the newest copy into a fresh directory on the host with a state
    file (one SFTP session). Baseline: scp(1) of the same files up.

Target: within 2x of scp for each (both cross the same loopback SSH).

    python benchmarks/ckpt_pull.py [--reps 5] [--mb 50] [--smoke]
"""
from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _common import ROOT, Bench, alternate, parser, report

TARGET = 2.0
MAKER = r"""
import sys, tensorflow as tf
floats = int(float(sys.argv[2]) * (1 << 20) / 4)
ckpt = tf.train.Checkpoint(w=tf.Variable(tf.random.uniform([floats])))
tf.train.CheckpointManager(ckpt, sys.argv[1], max_to_keep=2).save(checkpoint_number=100)
"""


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--mb", type=float, default=50.0, help="checkpoint size in MB (default 50)")
    args = p.parse_args()
    reps, mb = (1, 1.0) if args.smoke else (args.reps, args.mb)
    sys.path.insert(0, str(ROOT))
    with Bench("ckpt_pull") as b:
        os.environ["HOME"] = str(b.home)           # this process's SSH transport reads ~/.ssh here
        os.environ.pop("SSH_AUTH_SOCK", None)
        os.environ["TFCLUSTER_SSH_SYSTEM_CONFIG"] = ""     # not the machine's /etc/ssh/ssh_config
        sshd = b.start_sshd(["127.0.0.2"])
        ckpt_dir = b.tmp / "host" / "ckpt"
        subprocess.run([sys.executable, "-c", MAKER, str(ckpt_dir), str(mb)], check=True,
                       capture_output=True, timeout=300, env=b.env())
        files = sorted(f.name for f in ckpt_dir.iterdir() if f.name.startswith("ckpt-100."))
        size = sum((ckpt_dir / f).stat().st_size for f in files)
        print(f"checkpoint: {', '.join(files)}: {size / 1e6:.1f} MB")
        return measure(b, sshd, ckpt_dir, files, reps)


def measure(b: Bench, sshd, ckpt_dir: Path, files: list[str], reps: int) -> int:
    from tfcluster.launch.cluster.session import Session
    from tfcluster.launch.run.ckptsync import CheckpointSync
    from tfcluster.plan import build_plan
    from tfcluster.spec.loader import load_spec
    from tfcluster.ui import UI

    spec = b.tmp / "ck.yaml"
    push_dir = b.tmp / "host" / "pushed"
    spec.write_text(f"name: ck\npython: {sys.executable}\nworkdir: {b.tmp / 'work'}\n"
                    f"ssh:\n  port: {sshd.port}\n  connect_timeout: 10\n"
                    "hosts:\n  - {name: h, address: 127.0.0.2}\n"
                    "jobs:\n  ps: {tasks: ['h:2222']}\n  worker: {tasks: ['h:2223']}\n"
                    f"train:\n  checkpoint: {{dir: '{ckpt_dir}', keep: 2, sync: off}}\n")
    err = io.StringIO()
    counter = iter(range(10**6))
    with Session(build_plan(load_spec(str(spec))), UI(io.StringIO(), err, color=False)) as session:
        session.agent("h").prepare()
        sync = CheckpointSync(session, session.plan, str(b.tmp / "runs" / "warm"), session.ui)
        sync.pull("h")                               # the connection and the shim warm, as in a run

        def scp_pull() -> float:
            dest = b.tmp / f"scp-{next(counter)}"
            dest.mkdir()
            began = time.perf_counter()
            subprocess.run(["scp", "-q", *sshd.ssh_options()[:-2], "-P", str(sshd.port),
                            *[f"127.0.0.2:{ckpt_dir}/{f}" for f in files], str(dest)],
                           check=True, timeout=300, env=b.env())
            took = time.perf_counter() - began
            shutil.rmtree(dest)
            return took

        def tfc_pull() -> float:
            run = b.tmp / "runs" / f"r{next(counter)}"
            fresh = CheckpointSync(session, session.plan, str(run), session.ui)
            began = time.perf_counter()
            assert fresh.pull("h") is not None, err.getvalue()
            took = time.perf_counter() - began
            shutil.rmtree(run)
            return took

        def scp_push() -> float:
            shutil.rmtree(push_dir, ignore_errors=True)
            push_dir.mkdir(mode=0o700)
            began = time.perf_counter()
            subprocess.run(["scp", "-q", *sshd.ssh_options()[:-2], "-P", str(sshd.port),
                            *[str(ckpt_dir / f) for f in files], f"127.0.0.2:{push_dir}/"],
                           check=True, timeout=300, env=b.env())
            return time.perf_counter() - began

        def tfc_push() -> float:
            shutil.rmtree(push_dir, ignore_errors=True)
            target = CheckpointSync(session, _with_dir(session.plan, push_dir), str(b.tmp / "runs" / "warm"),
                                    session.ui)
            began = time.perf_counter()
            assert target.push("h") == "ckpt-100", err.getvalue()
            return time.perf_counter() - began

        print("pull:")
        base, tfc = alternate(reps, scp_pull, tfc_pull)
        met = report("ckpt_pull", "scp host:ckpt-100.* dir/", base, "CheckpointSync.pull", tfc, "s", TARGET)
        print("push:")
        base, tfc = alternate(reps, scp_push, tfc_push)
        met &= report("ckpt_push", "scp ckpt-100.* host:dir/", base, "CheckpointSync.push", tfc, "s", TARGET)
    if err.getvalue():
        print(err.getvalue())
    return 0 if met or reps == 1 else 1


def _with_dir(plan, directory: Path):
    from dataclasses import replace
    return replace(plan, checkpoint=replace(plan.checkpoint, dir=str(directory)))


if __name__ == "__main__":
    sys.exit(main())

"""Checkpoints that outlive their host (launch/run/ckptsync.py, host/shim_ckpt.py): the newest
complete checkpoint pulled from a real sshd host into the run directory, never a half-written
one, the newest `keep` kept, pushed to a fresh host where TensorFlow restores the same values;
a host that is gone is a warning. The checkpoints are TensorFlow's own, written once per module
by a TensorFlow subprocess (CheckpointManager, one of them in three shards)."""
from __future__ import annotations

import io
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ssh_spec, tfcluster, wait_for
from tests.sshd import kill_host, lone
from tfcluster.host import shim_ckpt
from tfcluster.launch.cluster.session import Session
from tfcluster.launch.run.ckptsync import CheckpointSync
from tfcluster.plan import build_plan
from tfcluster.spec.loader import load_spec
from tfcluster.ui import UI
from tfcluster.ui.units import size

pytestmark = [pytest.mark.timeout(120)]

GONE_ADDRESS = "127.0.0.33"     # a host of its own, killed by one test

# tf.compat.v1's MonitoredTrainingSession, as the between-graph and classic templates train:
# a Saver whose state file names absolute paths, a .meta beside each checkpoint. Returns the
# step it started from.
MONITORED_FN = r"""
def monitored(d, last_step):
    with tf.Graph().as_default():
        step = tf.compat.v1.train.get_or_create_global_step()
        tf.compat.v1.get_variable("w", initializer=tf.constant(3.0))
        train = tf.compat.v1.assign_add(step, 1)
        with tf.compat.v1.train.MonitoredTrainingSession(
                checkpoint_dir=d, save_checkpoint_steps=5, save_summaries_steps=None,
                hooks=[tf.compat.v1.train.StopAtStepHook(last_step=last_step)]) as s:
            start = s.run(step)
            while not s.should_stop():
                s.run(train)
    return int(start)
"""
MONITORED = ("import json, sys, tensorflow as tf\n" + MONITORED_FN
             + 'print(json.dumps({"start": monitored(sys.argv[1], int(sys.argv[2]))}))\n')

# Each save's variable `a` holds its number; the sharded ones are cut into three shards; a
# MonitoredTrainingSession's run to step 7.
MAKER = "import sys, tensorflow as tf\n" + MONITORED_FN + r"""
root = sys.argv[1]
a = tf.Variable(tf.zeros([1000]))
ckpt = tf.train.Checkpoint(a=a, b=tf.Variable(tf.ones([1000])))
plain = tf.train.CheckpointManager(ckpt, root + "/plain", max_to_keep=10)
for n in (10, 20, 30, 40, 50):
    a.assign(tf.fill([1000], float(n)))
    plain.save(checkpoint_number=n)
options = tf.train.CheckpointOptions(
    experimental_sharding_callback=tf.train.experimental.MaxShardSizePolicy(max_shard_size=3000))
sharded = tf.train.CheckpointManager(ckpt, root + "/sharded", max_to_keep=10)
for n in (5, 7):
    a.assign(tf.fill([1000], float(n)))
    sharded.save(checkpoint_number=n, options=options)
big = tf.train.Checkpoint(w=tf.Variable(tf.zeros([32 << 20])))         # 128 MiB
tf.train.CheckpointManager(big, root + "/big", max_to_keep=1).save(checkpoint_number=1)
assert monitored(root + "/monitored", 7) == 0
"""

# What a fresh chief does: the latest checkpoint of the directory, restored.
RESTORER = r"""
import json, sys, tensorflow as tf
d = sys.argv[1]
a = tf.Variable(tf.zeros([1000]))
ckpt = tf.train.Checkpoint(a=a, b=tf.Variable(tf.zeros([1000])))
latest = tf.train.latest_checkpoint(d)
manager = tf.train.CheckpointManager(ckpt, d, max_to_keep=2)
ckpt.restore(manager.latest_checkpoint).assert_consumed()
print(json.dumps({"latest": latest, "manager": manager.latest_checkpoint,
                  "a": sorted(set(a.numpy().tolist())), "b": float(ckpt.b.numpy().sum())}))
"""


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("made")
    subprocess.run([sys.executable, "-c", MAKER, str(root)], check=True, capture_output=True, timeout=90)
    return root


def restored(directory: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", RESTORER, str(directory)], check=True,
                         capture_output=True, text=True, timeout=90)
    return json.loads(out.stdout.splitlines()[-1])


def state(directory: Path, names: list[str]) -> None:
    """A state file as TensorFlow writes it, naming `names` (the last is the newest)."""
    (directory / "checkpoint").write_text(f'model_checkpoint_path: "{names[-1]}"\n'
                                          + "".join(f'all_model_checkpoint_paths: "{n}"\n' for n in names))


def keep_only(source: Path, target: Path, names: list[str]) -> Path:
    """`target`: the checkpoints `names` of `source` and a state file naming them."""
    target.mkdir(mode=0o700, parents=True)
    for f in source.iterdir():
        if f.name.split(".")[0] in names:
            shutil.copy(f, target / f.name)
    state(target, names)
    return target


class Harness:
    def __init__(self, spec: Path, run_dir: Path) -> None:
        self.err = io.StringIO()
        self.session = Session(build_plan(load_spec(str(spec))), UI(io.StringIO(), self.err, color=False))
        self.sync = CheckpointSync(self.session, self.session.plan, str(run_dir), self.session.ui)

    def warnings(self) -> list[str]:
        return [line for line in self.err.getvalue().splitlines() if line.strip()]


@pytest.fixture
def harness(tmp_path, sshd, ssh_home):
    made: list[Harness] = []

    def build(ckpt_dir: Path | str, keep: int = 2, sync: str = "off", sshd_=None, hosts: str = "") -> Harness:
        train = f"train:\n  checkpoint: {{dir: '{ckpt_dir}', keep: {keep}, sync: {sync}}}\n"
        spec = ssh_spec(tmp_path, sshd_ or sshd, train=train)
        if hosts:
            spec.write_text(spec.read_text().replace("hosts:\n", "hosts:\n" + hosts))
        made.append(Harness(spec, tmp_path / "runs" / "sshc-run"))
        return made[-1]

    yield build
    for h in made:
        h.sync.stop()
        h.session.close()


def files_of(path: str) -> set[str]:
    return set(os.listdir(path))


# ------------------------------------------------------------------ pull

@pytest.mark.tf
def test_pull_copies_the_newest_complete_checkpoint_privately(made, harness, tmp_path):
    h = harness(made / "plain")
    began = time.time()
    pulled = h.sync.pull("h2")
    assert pulled is not None, h.warnings()
    assert (pulled.name, pulled.step) == ("ckpt-50", 50)
    assert pulled.path == str(tmp_path / "runs" / "sshc-run" / "checkpoints" / "ckpt-50")
    assert files_of(pulled.path) == {"checkpoint", "ckpt-50.index", "ckpt-50.data-00000-of-00001"}
    for f in ("ckpt-50.index", "ckpt-50.data-00000-of-00001"):
        assert (Path(pulled.path) / f).read_bytes() == (made / "plain" / f).read_bytes()
        assert stat.S_IMODE(os.stat(Path(pulled.path) / f).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(pulled.path).st_mode) == 0o700
    assert pulled.bytes == sum((made / "plain" / f).stat().st_size
                               for f in ("ckpt-50.index", "ckpt-50.data-00000-of-00001"))
    assert began <= pulled.time <= time.time()
    assert h.sync.records() == [{"name": "ckpt-50", "step": 50, "bytes": pulled.bytes, "at": round(pulled.time, 3)}]
    assert not [f for f in os.listdir(Path(pulled.path).parent) if f.startswith(".")]   # no temporary left
    assert h.warnings() == []


@pytest.mark.tf
def test_a_checkpoint_without_its_index_or_a_shard_is_never_pulled(made, harness, tmp_path):
    no_index = keep_only(made / "plain", tmp_path / "no-index", ["ckpt-30", "ckpt-40", "ckpt-50"])
    (no_index / "ckpt-50.index").unlink()                       # TF was writing it
    (no_index / "ckpt-40.index").unlink()
    (no_index / "ckpt-40.index").symlink_to(made / "plain" / "ckpt-40.index")   # a link is no file of its
    assert shim_ckpt.newest_complete(str(no_index))[0] == "ckpt-30"
    h = harness(no_index)
    assert h.sync.pull("h2").name == "ckpt-30"

    shard_gone = keep_only(made / "sharded", tmp_path / "shard-gone", ["ckpt-5", "ckpt-7"])
    assert len(list(shard_gone.glob("ckpt-7.data-*-of-00003"))) == 3
    (shard_gone / "ckpt-7.data-00001-of-00003").unlink()
    h = harness(shard_gone)
    pulled = h.sync.pull("h3")
    assert pulled.name == "ckpt-5"
    assert files_of(pulled.path) == {"checkpoint", "ckpt-5.index"} | {
        f"ckpt-5.data-0000{i}-of-00003" for i in range(3)}
    assert restored(Path(pulled.path))["a"] == [5.0]            # the copy here restores by itself
    assert h.warnings() == []


@pytest.mark.tf
def test_a_save_of_the_same_name_torn_between_its_shard_and_its_index_is_never_pulled(made, harness, tmp_path):
    """A chief saves the step it just restored under the same name: TensorFlow renames the
    new shard into place, then writes the index. Its host killed in between leaves the old
    index over the new shard, which TensorFlow's own restore refuses; the pull takes the
    newest whole checkpoint before it, and the torn one once its index lands."""
    torn = tmp_path / "torn"
    torn.mkdir(mode=0o700)
    for f in (made / "plain").glob("ckpt-[45]0.*"):
        shutil.copy(f, torn / f.name)
    state(torn, ["ckpt-40", "ckpt-50"])
    saved = time.time() - 30               # ckpt-50's first save, 30 s ago
    for f in torn.glob("ckpt-*"):
        os.utime(f, (saved, saved))
    # the save again: another save's shard (other values, the same layout) renamed into place
    shutil.copy(made / "plain" / "ckpt-30.data-00000-of-00001", torn / ".part")
    os.rename(torn / ".part", torn / "ckpt-50.data-00000-of-00001")
    refused = subprocess.run([sys.executable, "-c", RESTORER, str(torn)], capture_output=True, text=True, timeout=90)
    assert refused.returncode != 0 and "DataLossError" in refused.stderr, refused.stderr[-2000:]

    assert shim_ckpt.newest_complete(str(torn))[0] == "ckpt-40"
    h = harness(torn)
    assert h.sync.pull("h2").name == "ckpt-40"
    shutil.copy(made / "plain" / "ckpt-30.index", torn / ".index")     # its index lands
    os.rename(torn / ".index", torn / "ckpt-50.index")
    pulled = h.sync.pull("h2")
    assert pulled.name == "ckpt-50"
    assert restored(Path(pulled.path))["a"] == [30.0]        # the new save's, whole
    assert h.warnings() == []


@pytest.mark.tf
def test_nothing_complete_is_nothing_pulled(made, harness, tmp_path):
    only = keep_only(made / "plain", tmp_path / "only", ["ckpt-50"])
    (only / "ckpt-50.data-00000-of-00001").unlink()
    h = harness(only)
    assert h.sync.pull("h2") is None and h.sync.kept() == [] and h.warnings() == []
    h = harness(tmp_path / "not-there-yet")
    assert h.sync.pull("h2") is None and h.warnings() == []


@pytest.mark.tf
def test_keep_is_honoured_and_a_pulled_checkpoint_is_not_copied_again(made, harness, tmp_path):
    live = keep_only(made / "plain", tmp_path / "live", ["ckpt-10"])
    h = harness(live, keep=2)
    got = [h.sync.pull("h2").name]
    for name in ("ckpt-20", "ckpt-30"):          # the chief saves again between two syncs
        for f in (made / "plain").glob(name + ".*"):
            shutil.copy(f, live / f.name)
        state(live, ["ckpt-10", name])
        got.append(h.sync.pull("h2").name)
    assert got == ["ckpt-10", "ckpt-20", "ckpt-30"]
    assert [c.name for c in h.sync.kept()] == ["ckpt-20", "ckpt-30"]
    again = h.sync.pull("h2")
    assert again == h.sync.kept()[-1]                            # the same copy, not a new one
    assert [r["name"] for r in h.sync.records()] == ["ckpt-10", "ckpt-20", "ckpt-30"]
    for f in ("index", "data-00000-of-00001"):       # a chief that restarted its count saves ckpt-30 anew
        shutil.copy(made / "plain" / f"ckpt-40.{f}", live / f"ckpt-30.{f}")
    renewed = h.sync.pull("h2")
    assert renewed.name == "ckpt-30" and renewed.time > again.time
    assert (Path(renewed.path) / "ckpt-30.index").read_bytes() == (made / "plain" / "ckpt-40.index").read_bytes()
    assert [r["name"] for r in h.sync.records()] == ["ckpt-10", "ckpt-20", "ckpt-30", "ckpt-30"]


@pytest.mark.tf
def test_a_dir_without_a_state_file_gives_its_highest_numbered_complete_checkpoint(made, tmp_path):
    loose = keep_only(made / "plain", tmp_path / "loose", ["ckpt-20", "ckpt-40", "ckpt-50"])
    (loose / "checkpoint").unlink()
    (loose / "ckpt-50.data-00000-of-00001").unlink()
    assert shim_ckpt.newest_complete(str(loose))[0] == "ckpt-40"


# ------------------------------------------------------------------ push

@pytest.mark.tf
def test_push_puts_the_newest_copy_where_tensorflow_restores_it(made, harness, tmp_path):
    h = harness(made / "plain")
    assert h.sync.push("h3") is None                             # nothing pulled yet: nothing to push
    assert h.sync.pull("h2").name == "ckpt-50"
    fresh = tmp_path / "fresh" / "ckpt"
    h2 = harness(fresh)                  # the same run directory; the dir on the new chief's host
    assert h2.sync.push("h3") == "ckpt-50"
    assert files_of(str(fresh)) == {"checkpoint", "ckpt-50.index", "ckpt-50.data-00000-of-00001"}
    after = restored(fresh)
    assert after == {"latest": str(fresh / "ckpt-50"), "manager": str(fresh / "ckpt-50"),
                     "a": [50.0], "b": 1000.0}
    assert h.warnings() == [] and h2.warnings() == []


def monitored(directory: Path, last_step: int) -> int:
    out = subprocess.run([sys.executable, "-c", MONITORED, str(directory), str(last_step)], check=True,
                         capture_output=True, text=True, timeout=90)
    return json.loads(out.stdout.splitlines()[-1])["start"]


@pytest.mark.tf
def test_a_monitored_training_sessions_checkpoint_is_pulled_and_resumed_from_on_a_fresh_host(made, harness,
                                                                                               tmp_path):
    old = made / "monitored"
    assert str(old / "model.ckpt-7") in (old / "checkpoint").read_text()     # absolute, as the Saver writes
    h = harness(old)
    pulled = h.sync.pull("h2")
    assert (pulled.name, pulled.step) == ("model.ckpt-7", 7)
    assert files_of(pulled.path) == {"checkpoint", "model.ckpt-7.index", "model.ckpt-7.meta",
                                     "model.ckpt-7.data-00000-of-00001"}
    fresh = tmp_path / "new-chief"
    assert harness(fresh).sync.push("h4") == "model.ckpt-7"
    assert monitored(fresh, 9) == 7                      # resumed at step 7, not from scratch
    assert h.warnings() == []


@pytest.mark.tf
def test_pull_and_push_expand_the_home_on_the_host(made, tmp_path, home):
    """A local host: the shim runs with this HOME, so `~/` is the test's home."""
    keep_only(made / "plain", home / "ckpt", ["ckpt-40"])
    spec = tmp_path / "loc.yaml"
    spec.write_text(f"name: loc\nworkdir: {tmp_path / 'remote'}\nhosts:\n  - {{name: local, address: 127.0.0.1}}\n"
                    "jobs:\n  ps: {tasks: ['local:2222']}\n  worker: {tasks: ['local:2223']}\n"
                    "train:\n  checkpoint: {dir: '~/ckpt', sync: off}\n")
    err = io.StringIO()
    with Session(build_plan(load_spec(str(spec))), UI(io.StringIO(), err, color=False)) as session:
        sync = CheckpointSync(session, session.plan, str(tmp_path / "runs" / "loc-run"), session.ui)
        assert sync.pull("local").name == "ckpt-40"
        shutil.rmtree(home / "ckpt")
        assert sync.push("local") == "ckpt-40"
    assert files_of(str(home / "ckpt")) == {"checkpoint", "ckpt-40.index", "ckpt-40.data-00000-of-00001"}
    assert err.getvalue() == ""


# ------------------------------------------------------------------ failures, the thread

@pytest.mark.tf
def test_a_pull_from_a_host_that_is_gone_is_a_warning(made, harness, sshd_factory, ssh_home):
    server = lone(sshd_factory, ssh_home, GONE_ADDRESS)
    h = harness(made / "plain", sshd_=server, hosts=f"  - {{name: gone, address: {GONE_ADDRESS}}}\n")
    assert h.sync.pull("gone").name == "ckpt-50"
    kill_host(server)
    began = time.monotonic()
    assert h.sync.pull("gone") is None
    assert time.monotonic() - began < 30
    [warning] = h.warnings()
    assert warning.startswith(f"tfcluster: warning: checkpoint sync: pull of {made / 'plain'} failed: "
                              f"host gone ({GONE_ADDRESS}:{server.port}): connection refused")
    copy = h.sync.kept()[-1]
    assert warning.endswith(f"; the newest copy here is ckpt-50 ({size(copy.bytes)}, {copy.path})")
    assert [c.name for c in h.sync.kept()] == ["ckpt-50"]


@pytest.mark.tf
def test_a_run_directory_that_cannot_hold_the_copy_is_a_warning(made, harness, tmp_path):
    h = harness(made / "plain")
    (tmp_path / "runs" / "sshc-run").mkdir(parents=True)
    (tmp_path / "runs" / "sshc-run" / "checkpoints").write_text("not a directory")
    assert h.sync.pull("h2") is None
    said = (f"tfcluster: warning: checkpoint sync: pull of {made / 'plain'} failed: on this machine: "
            f"checkpoints: {tmp_path / 'runs' / 'sshc-run' / 'checkpoints'} is not a directory; "
            "no copy is kept here yet")
    assert h.warnings() == [said]


@pytest.mark.tf
def test_the_sync_thread_pulls_every_interval_and_stops_within_its_bound(made, harness, tmp_path):
    live = keep_only(made / "plain", tmp_path / "live", ["ckpt-10"])
    h = harness(live, sync="1s")
    hosts = ["h2"]
    h.sync.start(lambda: hosts[0])
    wait_for(lambda: [c.name for c in h.sync.kept()] == ["ckpt-10"], timeout=20, what="the first sync")
    for f in (made / "plain").glob("ckpt-20.*"):
        shutil.copy(f, live / f.name)
    state(live, ["ckpt-10", "ckpt-20"])
    hosts[0] = "h3"                                              # the chief moved: the next sync follows
    wait_for(lambda: [c.name for c in h.sync.kept()] == ["ckpt-10", "ckpt-20"], timeout=20, what="the second")
    began = time.monotonic()
    h.sync.stop()
    assert time.monotonic() - began < 11 and not h.sync._thread.is_alive()
    assert h.warnings() == []


@pytest.mark.tf
def test_the_sync_thread_says_a_failure_once_until_a_pull_works(made, harness, tmp_path):
    h = harness(made / "plain", sync="1s")
    run = tmp_path / "runs" / "sshc-run"
    run.mkdir(parents=True)
    (run / "checkpoints").write_text("not a directory")
    asked = []
    h.sync.start(lambda: asked.append(1) or "h2")
    wait_for(lambda: len(asked) >= 4, timeout=30, what="three failed syncs")
    assert len(h.warnings()) == 1 and "is not a directory" in h.warnings()[0]
    (run / "checkpoints").unlink()
    wait_for(lambda: h.sync.kept(), timeout=20, what="a sync that works")
    h.sync.stop()
    assert len(h.warnings()) == 1
    assert h.sync.pull("h2").name == "ckpt-50"      # a direct pull always speaks; this one has nothing to say


@pytest.mark.tf
def test_a_pull_dropped_midway_leaves_nothing_half_there(made, harness, tmp_path):
    import threading

    h = harness(made / "big")
    results = []
    puller = threading.Thread(target=lambda: results.append(h.sync.pull("h2")))
    puller.start()
    root = tmp_path / "runs" / "sshc-run" / "checkpoints"
    wait_for(lambda: any(f.stat().st_size for d in root.glob(".pull-*") for f in d.iterdir()),
             timeout=20, interval=0.01, what="the copy to begin")
    h.sync.stop()                                      # drops the pull in flight
    puller.join(10)
    assert results == [None] and not puller.is_alive()
    assert os.listdir(root) == [] and h.sync.kept() == [] and h.sync.records() == []
    assert h.warnings() == []


@pytest.mark.tf
def test_no_thread_with_sync_off(made, harness):
    h = harness(made / "plain", sync="off")
    h.sync.start(lambda: "h2")
    assert h.sync._thread is None


# ------------------------------------------------------------------ the parts without a host

def test_the_state_file_is_read_as_tensorflow_writes_it(tmp_path):
    text = ('model_checkpoint_path: "/data/run\\"1\\"/model.ckpt-300"\n'
            'all_model_checkpoint_paths: "/data/run\\"1\\"/model.ckpt-100"\n'
            'all_model_checkpoint_paths: "model.ckpt-200"\n'
            'all_model_checkpoint_paths: "/data/run\\"1\\"/model.ckpt-300"\n'
            "all_model_checkpoint_timestamps: 1795745895.8\nlast_preserved_timestamp: 1795745894.7\n")
    assert shim_ckpt.state_paths(text) == ['/data/run"1"/model.ckpt-300', "model.ckpt-200",
                                           '/data/run"1"/model.ckpt-100']
    assert shim_ckpt.unescape(r"caf\303\251\\x") == "caf\u00e9\\x"
    inside = tmp_path / "ckpt"
    inside.mkdir()
    assert shim_ckpt._in_dir(str(inside), f"{inside}/model.ckpt-3") == "model.ckpt-3"   # tf.compat.v1's Saver
    assert shim_ckpt._in_dir(str(inside), "/elsewhere/model.ckpt-3") is None
    assert shim_ckpt._in_dir(str(inside), "sub/model.ckpt-3") is None


RUN = "lab-20261127-020000-ab12"


def test_runs_and_logs_show_the_checkpoints_a_run_kept(tmp_path, home):
    spec = tmp_path / "lab.yaml"
    spec.write_text("name: lab\nhosts:\n  - {name: local, address: 127.0.0.1}\n"
                    "jobs:\n  ps: {tasks: ['local:2222']}\n  worker: {tasks: ['local:2223']}\n")
    run = tmp_path / "runs" / RUN
    for name, size_, at in (("ckpt-20", 1000, 100.0), ("ckpt-30", 3000, 200.0)):
        (run / "checkpoints" / name).mkdir(parents=True)
        (run / "checkpoints" / name / f"{name}.index").write_bytes(b"i" * 100)
        (run / "checkpoints" / name / f"{name}.data-00000-of-00001").write_bytes(b"d" * (size_ - 100))
        (run / "checkpoints" / name / "checkpoint").write_text(f'model_checkpoint_path: "{name}"\n')
        os.utime(run / "checkpoints" / name, (at, at))
    (run / "checkpoints" / ".pull-x1y2").mkdir()                    # a copy still being written
    (run / "manifest.json").write_text(json.dumps({"outcome": "succeeded", "exit_code": 0, "started": 1.0,
                                                   "ended": 2.0, "checkpoints": []}))
    (run / "worker-0.log").write_text("step=30 loss=0.5\n")
    listed = tfcluster("runs", str(spec), home=home, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "checkpoint" in listed.stdout and "ckpt-30 (step 30)" in listed.stdout
    rows = json.loads(tfcluster("runs", str(spec), "--json", home=home, cwd=tmp_path).stdout)["runs"]
    assert rows[0]["checkpoint"] == {"name": "ckpt-30", "step": 30, "bytes": 3000, "at": 200.0,
                                     "path": os.path.join("runs", RUN, "checkpoints", "ckpt-30")}
    logs = tfcluster("logs", str(spec), home=home, cwd=tmp_path)
    assert logs.returncode == 0, logs.stderr
    assert logs.stderr.splitlines()[1:3] == [
        f"checkpoint ckpt-20 (step 20, 1.0 kB): runs/{RUN}/checkpoints/ckpt-20",
        f"checkpoint ckpt-30 (step 30, 3.0 kB): runs/{RUN}/checkpoints/ckpt-30"]
    assert logs.stdout.endswith("step=30 loss=0.5\n")

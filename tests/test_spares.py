"""Spare hosts, train.on_host_loss and train.checkpoint: the spec's rejections with their exact
messages, the values they load to, and the plans they make (Plan.moved, Plan.spare_for); one
`plan --check` against a real sshd with a spare that cannot be reached."""
from __future__ import annotations

import json
import re
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from tests.helpers import SaidUi, tagged_processes, tfcluster
from tests.tf_launch import free_ports
from tfcluster.errors import SpecError
from tfcluster.launch.agent import fence
from tfcluster.plan import CheckpointPlan, build_plan, plan_to_dict
from tfcluster.spec import Checkpoint, load_spec

HOSTS = """\
name: t
hosts:
  - {name: a, address: 10.0.0.1}
  - {name: g, address: 10.0.0.2, gpus: 2}
  - {name: s, address: 10.0.0.5, gpus: 2, spare: true}
"""
JOBS = """\
jobs:
  ps: {count: 1, hosts: [a], port: 2222}
  worker: {count: 2, hosts: [g], port: 2300, gpus: 1}
"""
BASE = HOSTS + JOBS          # lines 1-8; anything appended starts on line 9
NO_SPARE = BASE.replace(", spare: true", "")

SYNC_PROBLEM = "10: train.checkpoint.sync: must be a positive number of seconds or a duration like 90s, 30m, 2h (at most 8784h, a year), or off; got "

# (id, yaml text, "LINE: field: problem" after "FILE:")
REJECTIONS = [
    ("spare-not-bool", BASE.replace("spare: true", "spare: yes"), "5: hosts[2].spare: must be true, false or warm, got 'yes'"),
    ("job-hosts-name-a-spare", BASE.replace("hosts: [g]", "hosts: [g, s]"),
     "8: jobs.worker.hosts[1]: s is a spare: it takes tasks only when a host is lost"),
    ("job-tasks-name-a-spare", BASE.replace("{count: 2, hosts: [g], port: 2300, gpus: 1}", "{tasks: ['g:2300', 's:2300']}"),
     "8: jobs.worker.tasks[1]: s is a spare: it takes tasks only when a host is lost"),
    ("spare-on-loopback-among-remote-hosts", BASE.replace("10.0.0.5", "127.0.0.5"),
     ("5: hosts[2].address: host s is at loopback address 127.0.0.5 but host a is at 10.0.0.1: tasks on a "
      "would dial 127.0.0.5 and reach themselves, not s")),
    ("on-host-loss-unknown", BASE + "train: {on_host_loss: move}\n",
     "9: train.on_host_loss: unknown on_host_loss 'move'; expected one of: spare, shrink, fail"),
    ("on-host-loss-typo", BASE + "train: {on_host_loss: shrnik}\n",
     "9: train.on_host_loss: unknown on_host_loss 'shrnik'; did you mean 'shrink'?"),
    ("on-host-loss-spare-without-a-spare", NO_SPARE + "train:\n  mode: classic\n  on_host_loss: spare\n",
     "11: train.on_host_loss: spare needs a spare host, and no host entry says spare: true"),
    ("checkpoint-not-a-mapping", BASE + "train: {checkpoint: /data/ckpt}\n",
     "9: train.checkpoint: must be a mapping, got '/data/ckpt'"),
    ("checkpoint-without-dir", BASE + "train:\n  checkpoint: {keep: 2}\n", "10: train.checkpoint.dir: missing required key"),
    ("checkpoint-empty-dir", BASE + "train:\n  checkpoint: {dir: ''}\n",
     "10: train.checkpoint.dir: must name a directory, got an empty string"),
    ("checkpoint-relative-dir", BASE + "train:\n  checkpoint: {dir: ckpt}\n",
     "10: train.checkpoint.dir: must be absolute, start with ~/ or {workdir}, got 'ckpt': relative to what the "
     "script sees, its run's directory, it would be a new one each run (nothing to resume from)"),
    ("checkpoint-unknown-placeholder", BASE + "train:\n  checkpoint: {dir: '{rundir}/ckpt'}\n",
     ("10: train.checkpoint.dir: unknown placeholder {rundir}; known: job, index, ps_hosts, worker_hosts, "
      "chief_hosts, workdir, num_workers")),
    ("checkpoint-keep-zero", BASE + "train:\n  checkpoint: {dir: /c, keep: 0}\n",
     "10: train.checkpoint.keep: must be an integer from 1 to 1000, got 0"),
    ("checkpoint-keep-text", BASE + "train:\n  checkpoint: {dir: /c, keep: all}\n",
     "10: train.checkpoint.keep: must be a decimal integer, got 'all'"),
    ("checkpoint-sync-word", BASE + "train:\n  checkpoint: {dir: /c, sync: often}\n",
     SYNC_PROBLEM + "'often'"),
    ("checkpoint-sync-zero", BASE + "train:\n  checkpoint: {dir: /c, sync: 0}\n",
     SYNC_PROBLEM + "'0'"),
    ("checkpoint-sync-quoted-off", BASE + "train:\n  checkpoint: {dir: /c, sync: 'off'}\n",
     SYNC_PROBLEM + "the quoted string 'off' (write it without quotes)"),
    ("checkpoint-unknown-key", BASE + "train:\n  checkpoint: {dir: /c, every: 2m}\n",
     "10: train.checkpoint.every: unknown key 'every'; expected one of: dir, keep, sync, max_bytes"),
]


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.mark.parametrize("text,expected", [c[1:] for c in REJECTIONS], ids=[c[0] for c in REJECTIONS])
def test_rejects_with_exact_message(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(info.value) == f"{path}:{expected}"


def test_a_job_naming_a_spare_hints_how_to_give_it_tasks(tmp_path):
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, BASE.replace("hosts: [g]", "hosts: [s]")))
    assert info.value.hint == "remove spare: true from host s to give it tasks"


def test_a_spare_loads_marked_and_a_host_is_no_spare_by_default(tmp_path):
    spec = load_spec(write(tmp_path, BASE))
    assert [(h.name, h.spare) for h in spec.hosts] == [("a", False), ("g", False), ("s", True)]
    assert [h.name for h in spec.spares] == ["s"]
    assert load_spec(write(tmp_path, BASE.replace("spare: true", "spare: false"))).spares == ()


@pytest.mark.parametrize("text,spec_value,plan_value", [
    (NO_SPARE, None, "fail"),
    (BASE, None, "spare"),
    (BASE + "train: {on_host_loss: shrink}\n", "shrink", "shrink"),
    (BASE + "train: {on_host_loss: fail}\n", "fail", "fail"),
    (NO_SPARE + "train: {on_host_loss: shrink}\n", "shrink", "shrink"),
])
def test_on_host_loss_defaults_to_spare_only_when_the_spec_has_a_spare(tmp_path, text, spec_value, plan_value):
    spec = load_spec(write(tmp_path, text))
    assert spec.train.on_host_loss == spec_value
    assert build_plan(spec).on_host_loss == plan_value


@pytest.mark.parametrize("written,loaded,planned", [
    ("{dir: '{workdir}/ckpt'}", Checkpoint("{workdir}/ckpt", 2, 120.0, 10),
     CheckpointPlan("~/.tfcluster/t/ckpt", 2, 120.0)),
    ("{dir: '/data/{job}-{index}', keep: 5, sync: 2m}", Checkpoint("/data/{job}-{index}", 5, 120.0, 10),
     CheckpointPlan("/data/worker-0", 5, 120.0)),
    ("{dir: /shared/ckpt, sync: off}", Checkpoint("/shared/ckpt", 2, None, 10), CheckpointPlan("/shared/ckpt", 2, None)),
    ("{dir: /c, sync: 90}", Checkpoint("/c", 2, 90.0, 10), CheckpointPlan("/c", 2, 90.0)),
    ("{dir: /c, sync: 1.5h, keep: 1}", Checkpoint("/c", 1, 5400.0, 10), CheckpointPlan("/c", 1, 5400.0)),
])
def test_checkpoint_loads_as_written_and_plans_with_the_chiefs_placeholders(tmp_path, written, loaded, planned):
    spec = load_spec(write(tmp_path, BASE + f"train:\n  checkpoint: {written}\n"))
    assert spec.train.checkpoint == loaded
    assert build_plan(spec).checkpoint == planned


def test_a_spec_without_checkpoint_plans_none(tmp_path):
    spec = load_spec(write(tmp_path, BASE))
    assert spec.train.checkpoint is None and build_plan(spec).checkpoint is None


def test_checkpoint_placeholders_are_the_chiefs_when_there_is_one(tmp_path):
    text = BASE.replace("  worker:", "  chief: {count: 1, hosts: [a], port: 2400}\n  worker:")
    plan = build_plan(load_spec(write(tmp_path, text + "train:\n  checkpoint: {dir: '/c/{job}{index}'}\n")))
    assert plan.checkpoint.dir == "/c/chief0"


# --------------------------------------------------------------------------- plans

MANY = """\
name: t
hosts:
  - {name: a, address: 10.0.0.1}
  - {name: b, address: 10.0.0.2, gpus: 2}
  - {name: c, address: 10.0.0.3, gpus: 1}
  - {name: z, address: 10.0.0.9, spare: true}
  - {name: s, address: 10.0.0.5, gpus: 2, spare: true}
  - {name: t, address: 10.0.0.6, gpus: 4, spare: true}
jobs:
  ps: {count: 1, hosts: [a], port: 2222}
  worker: {count: 3, hosts: [b, c], port: 2300, gpus: 1}
"""


@pytest.fixture
def many(tmp_path):
    return build_plan(load_spec(write(tmp_path, MANY)))


def test_spares_are_in_all_hosts_not_in_hosts_in_spec_order(many):
    assert many.spares == ("z", "s", "t")
    assert many.hosts == ("a", "b", "c")
    assert [h.name for h in many.all_hosts] == ["a", "b", "c", "s", "t", "z"]
    assert many.moves == ()


def test_spare_for_picks_the_first_spare_in_spec_order_with_the_gpus(many):
    assert many.spare_for("a") == "z"                   # ps: no GPUs, the first spare
    assert many.spare_for("b") == "s"                   # two GPUs: z has none
    assert many.spare_for("b", used=["s"]) == "t"
    assert many.spare_for("b", used=["s", "t"]) is None
    assert many.spare_for("c") == "s"
    assert many.spare_for("z") is None                  # a host with no task needs no spare


def test_spare_for_skips_a_spare_that_already_took_a_hosts_tasks(many):
    moved = many.moved("c", "s")
    assert moved.spare_for("b") == "t"
    assert moved.spare_for("a") == "z"


def test_spare_for_skips_a_spare_whose_machine_has_the_port_taken(tmp_path):
    # one machine seen under two names: the spare's port 2300 is a's
    text = """\
    name: t
    hosts:
      - {name: a, address: 127.0.0.2}
      - {name: b, address: 127.0.0.3}
      - {name: s, address: 127.0.0.5, spare: true}
      - {name: u, address: 127.0.0.6, spare: true}
    jobs:
      ps: {tasks: ['a:2300']}
      worker: {tasks: ['b:2301', 'a:2302']}
    """
    plan = build_plan(load_spec(write(tmp_path, text)))
    assert plan.spare_for("b") == "s"
    assert plan.spare_problem("s", "b") is None
    clash = build_plan(load_spec(write(tmp_path, text.replace("b:2301", "b:2300").replace("a:2300", "a:2303"))))
    # b's worker:0 on 2300: another loopback host has nothing on 2300 now, so a spare fits
    assert clash.spare_for("b") == "s"
    same = build_plan(load_spec(write(tmp_path, text.replace("'b:2301', 'a:2302'", "'b:2301', 'a:2301'")
                                      .replace("127.0.0.3", "10.0.0.3").replace("127.0.0.2", "10.0.0.2")
                                      .replace("127.0.0.5", "10.0.0.2").replace("127.0.0.6", "10.0.0.6"))))
    # s is a's machine (same address), where port 2301 is worker:1's: b's worker:0 cannot go there
    assert same.spare_problem("s", "b") == "port 2301 (worker:0) is worker:1's on its machine"
    assert same.spare_for("b") == "u"


def test_moved_plan_is_the_plan_of_the_same_cluster_written_on_the_spare(tmp_path):
    lost = build_plan(load_spec(write(tmp_path, BASE, "lost.yaml")))
    moved = lost.moved("g", "s")
    written = build_plan(load_spec(write(tmp_path, BASE.replace("hosts: [g]", "hosts: [s]")
                                         .replace(", spare: true", ""), "written.yaml")))
    assert moved.tasks == written.tasks          # addresses, ports, GPUs, TF_CONFIG, env, argv
    assert moved.cluster == written.cluster
    assert moved.hosts == ("a", "s")
    assert moved.moves == (("g", "s"),)
    assert moved.spares == ("s",)
    assert moved.task("ps:0").tf_config == (
        '{"cluster":{"ps":["10.0.0.1:2222"],"worker":["10.0.0.5:2300","10.0.0.5:2301"]},'
        '"task":{"index":0,"type":"ps"}}')
    assert lost.hosts == ("a", "g") and lost.moves == ()       # the plan itself is unchanged


def test_moved_keeps_job_index_and_port_and_numbers_the_spares_gpus_from_0(many):
    twice = many.moved("b", "t").moved("c", "t")        # one spare taking two hosts' tasks
    assert [(t.key, t.host, t.port, t.gpus) for t in twice.tasks] == [
        ("ps:0", "a", 2222, ()),
        ("worker:0", "t", 2300, (0,)),
        ("worker:1", "t", 2300, (1,)),
        ("worker:2", "t", 2301, (2,)),
    ]
    assert twice.moves == (("b", "t"), ("c", "t"))


def test_a_moved_host_can_move_again(many):
    again = many.moved("a", "z").moved("z", "s")
    assert again.task("ps:0").host == "s" and again.task("ps:0").address == "10.0.0.5"
    assert again.moves == (("a", "z"), ("z", "s"))
    assert "10.0.0.5:2222" in again.task("worker:0").tf_config


def test_moved_refuses_a_host_that_is_no_spare_and_a_host_without_tasks(many):
    with pytest.raises(ValueError, match="c is not a spare host"):
        many.moved("b", "c")
    with pytest.raises(ValueError, match="host z holds no task"):
        many.moved("z", "s")
    with pytest.raises(ValueError, match="too few for the tasks"):
        many.moved("c", "z")
    with pytest.raises(ValueError, match="not made by build_plan"):
        replace(many, source=None).moved("b", "s")


def test_plans_compare_without_their_spec_and_json_holds_no_spec(many, tmp_path):
    assert many == build_plan(load_spec(write(tmp_path, MANY, "again.yaml")))
    assert "source" not in repr(many) and "Spec(" not in repr(many)
    data = plan_to_dict(many.moved("b", "s"))
    assert "source" not in data
    json.dumps(data)
    assert data["on_host_loss"] == "spare"
    assert data["moves"] == [{"lost": "b", "to": "s"}]
    assert data["checkpoint"] is None
    assert data["spares"][0] == {"name": "z", "address": "10.0.0.9", "gpus": 0, "warm": False, "holds": [], "takes": ["a"],
                                 "cannot_take": {"s": "has 0 GPUs, s's tasks need 2", "c": "has 0 GPUs, c's tasks need 1"}}
    assert data["spares"][1]["holds"] == ["worker:0", "worker:2"]


def test_fence_lets_the_spares_reach_the_ports_and_closes_an_idle_spares_way_out(many):
    many = replace(many, tf_ports="auto")
    req = fence.request(many, "b", fence.INSTALL)
    assert req["peers"] == ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.5", "10.0.0.6", "10.0.0.9"]
    assert req["mode"] == fence.INSTALL
    spare = fence.request(many, "s", fence.INSTALL)
    # nothing binds on an idle spare, but its users must not dial the others' ports
    assert spare["mode"] == fence.INSTALL and spare["ports"] == []
    assert sorted(map(tuple, spare["targets"])) == sorted((t.address, t.port) for t in many.tasks)
    assert fence.request(many.moved("b", "s"), "s", fence.INSTALL)["mode"] == fence.INSTALL


def test_a_table_for_a_move_not_yet_decided_closes_both_clusters_ports(many):
    """While the grace decides whether a host is lost, each other host's table closes the
    cluster's ports as it is and as the move would make it: right for either outcome."""
    many = replace(many, tf_ports="auto")
    moved = many.moved("b", "s")
    both = fence.request(many, "s", fence.INSTALL, also=moved)
    targets = {tuple(t) for t in both["targets"]}
    assert targets == {(t.address, t.port) for p in (many, moved) for t in p.tasks}
    assert {("10.0.0.2", 2300), ("10.0.0.5", 2300)} <= targets      # the old worker's and the moved one's
    assert both["ports"] == sorted({t.port for t in moved.tasks_on("s")}) != []   # the spare's own, once it takes them
    assert both["peers"] == fence.request(many, "s", fence.INSTALL)["peers"]
    assert fence.request(replace(many, tf_ports="open"), "a", fence.INSTALL, also=moved) is None


def test_plan_command_shows_the_spares_what_they_take_the_loss_policy_and_the_checkpoints(tmp_path):
    path = write(tmp_path, MANY + "train:\n  checkpoint: {dir: '{workdir}/ckpt', keep: 3, sync: 2m}\n")
    shown = tfcluster("plan", path, home=tmp_path, cwd=tmp_path, timeout=60)
    assert shown.returncode == 0, shown.stderr
    rows = {line.split()[0]: line for line in shown.stdout.splitlines() if re.match(r"[zst] ", line)}
    assert rows["z"].split()[:4] == ["z", "10.0.0.9", "-", "a"] and "not b: has 0 GPUs, b's tasks need 2" in rows["z"]
    assert rows["s"].split()[:4] == ["s", "10.0.0.5", "2", "a,"] and rows["s"].rstrip().endswith("a, b, c")
    assert "on a lost host (train.on_host_loss: spare):\n  holding a ps: every task starts again on the new cluster, " \
           "from the checkpoint (a ps held the variables)\n" in shown.stdout
    assert ("checkpoints: ~/.tfcluster/t/ckpt on the chief's host, 3 kept, the newest complete one copied "
            "here every 2m00s") in shown.stdout
    as_json = json.loads(tfcluster("plan", path, "--json", home=tmp_path, cwd=tmp_path, timeout=60).stdout)
    assert [s["name"] for s in as_json["spares"]] == ["z", "s", "t"]
    assert as_json["checkpoint"] == {"dir": "~/.tfcluster/t/ckpt", "keep": 3, "sync": 120.0,
                                   "max_bytes": 16 << 30}


def test_plans_loss_lines_follow_what_the_spares_can_take_and_whether_a_checkpoint_is_kept(tmp_path):
    """A spare too small for a host's tasks is no spare for that host's loss, and a restart
    without train.checkpoint is from whatever the script keeps itself: the lines say so."""
    path = write(tmp_path, "name: pg\nhosts:\n  - {name: h1, address: 10.0.0.1, gpus: 4}\n"
                           "  - {name: h2, address: 10.0.0.2, gpus: 4}\n"
                           "  - {name: h5, address: 10.0.0.5, gpus: 2, spare: true}\n"
                           "jobs:\n  ps: {count: 1, hosts: [h1], port: 2222}\n"
                           "  worker: {per_gpu: true, hosts: [h2], port: 2300}\n"
                           "train: {script: 'template:between_graph'}\n")
    shown = tfcluster("plan", path, home=tmp_path, cwd=tmp_path, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert ("  holding a ps: every task starts again on the new cluster, from the script's own checkpoint "
            "if it keeps one (no train.checkpoint) (a ps held the variables)\n"
            "  holding the chief: the run ends, naming the host (no spare can take h2's tasks: h5 has 2 "
            "GPUs, h2's tasks need 4)\n") in shown.stdout, shown.stdout


# --------------------------------------------------------------------------- plan --check

@pytest.mark.ssh
@pytest.mark.timeout(120)
def test_plan_check_warns_of_spares_it_cannot_reach_or_that_fail_a_check_and_exits_0(tmp_path, home, ssh_home, sshd):
    ports = free_ports(3)
    dead = free_ports(1)[0]        # nothing listens there: the spare's sshd is not running
    spec = tmp_path / "spares.yaml"
    spec.write_text(
        f"name: spares\npython: {sys.executable}\nworkdir: {tmp_path / 'remote'}\n"
        f"ssh:\n  port: {sshd.port}\n  connect_timeout: 5\n"
        "hosts:\n  - {name: h2, address: 127.0.0.2}\n  - {name: h3, address: 127.0.0.3}\n"
        "  - {name: h4, address: 127.0.0.4, spare: true}\n"
        "  - {name: g4, address: 127.0.0.4, spare: true, gpus: 1}\n"      # the box has no GPU
        f"  - {{name: h9, address: 127.0.0.9, spare: true, ssh: {{port: {dead}}}}}\n"
        f"jobs:\n  ps: {{tasks: ['h2:{ports[0]}']}}\n  worker: {{tasks: ['h3:{ports[1]}', 'h3:{ports[2]}']}}\n"
        "tf_ports: open\n")
    result = tfcluster("plan", str(spec), "--check", home=home, cwd=tmp_path, timeout=100)
    assert result.returncode == 0, result.stderr
    assert f"tfcluster: warning: spare h9 not usable: 127.0.0.9:{dead}: connection refused" in result.stderr
    assert "tfcluster: warning: spare g4 not usable: the spec gives it 1 GPUs but it has 0" in result.stderr
    assert "preflight passed" in result.stderr
    table = [line.split()[0] for line in result.stderr.splitlines() if re.match(r"h\d ", line)]
    assert table == ["h2", "h3", "h4"]          # the reachable spare is checked like the others
    assert "spare h4" not in result.stderr
    assert not tagged_processes()


@pytest.mark.parametrize("engine", ["slurm", "tfjob"])
def test_render_says_spares_and_checkpoints_do_not_carry_over(tmp_path, engine):
    path = write(tmp_path, MANY + "train:\n  script: template:between_graph\n  checkpoint: {dir: '{workdir}/ckpt'}\n")
    shown = tfcluster("render", path, "--to", engine, "--image", "tf:x", "-o", str(tmp_path / "out"),
                      home=tmp_path, cwd=tmp_path, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "spare hosts, train.on_host_loss and train.checkpoint do not carry over" in shown.stderr


# --------------------------------------------------------------------------- `up`'s moves, saved


def test_the_moves_up_saved_are_applied_and_said_once_each(many):
    from tfcluster.launch.cluster.state import UpState, placed_by_up

    said = SaidUi()
    placed = placed_by_up(many, said, UpState(moves=(("a", "z"), ("c", "s"))))
    assert placed == many.moved("a", "z").moved("c", "s")
    assert said.lines == ["info ps:0 runs on spare z (moved there by `up`: a was down)",
                          "info worker:1 runs on spare s (moved there by `up`: c was down)"]
    assert placed_by_up(many, said, UpState()) is many and len(said.lines) == 2     # nothing saved


def test_the_running_trains_moves_are_applied_only_while_that_train_holds_the_lock(many, home):
    """What `status` and `drain` plan with while a `train` runs: the moves it published, with its
    pid, as long as the lock file names that live process as a `train`; nothing otherwise."""
    import os
    import subprocess

    from tfcluster.launch.cluster import state

    directory = Path(state.state_dir(state.key(many)))
    state.publish_moves(many.moved("a", "z"))          # as the train does: this process's pid
    lock = directory / "lock"
    said = SaidUi()
    for holder in ("", state.HOLDER.format(pid=os.getpid(), command="up")):   # no train holds it
        lock.write_text(holder)
        assert state.placed_by_train(many, said) is None
    lock.write_text(state.HOLDER.format(pid=os.getpid(), command="train"))
    assert state.placed_by_train(many, said) == many.moved("a", "z")
    assert said.lines == ["info ps:0 runs on spare z (moved there by the running train: a was lost or drained)"]
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    assert oct(os.stat(directory / state.MOVES).st_mode & 0o777) == "0o600"
    # a train that died holding it (SIGKILL leaves its lock file's words and its moves)
    (directory / state.MOVES).write_text(json.dumps({"pid": gone.pid, "moves": [["a", "z"]]}))
    lock.write_text(state.HOLDER.format(pid=gone.pid, command="train"))
    assert state.placed_by_train(many, said) is None and len(said.lines) == 1


@pytest.mark.parametrize("edit, why", [
    (lambda t: t.replace("  - {name: s, address: 10.0.0.5, gpus: 2, spare: true}\n", ""),
     "the spec no longer lists s"),
    (lambda t: t.replace("{name: s, address: 10.0.0.5, gpus: 2, spare: true}", "{name: s, address: 10.0.0.5, gpus: 2}"),
     "s is no longer a spare in the spec"),
    (lambda t: t.replace("  - {name: c, address: 10.0.0.3, gpus: 1}\n", "").replace("count: 3, hosts: [b, c]", "count: 2, hosts: [b]"),
     "the spec no longer lists c"),
    (lambda t: t.replace("{name: s, address: 10.0.0.5, gpus: 2, spare: true}", "{name: s, address: 10.0.0.5, spare: true}"),
     "s cannot take them (has 0 GPUs, c's tasks need 1)"),
])
def test_a_saved_move_the_edited_spec_no_longer_allows_is_ignored_with_one_warning(tmp_path, edit, why):
    from tfcluster.launch.cluster.state import UpState, placed_by_up

    plan = build_plan(load_spec(write(tmp_path, edit(MANY))))
    said = SaidUi()
    assert placed_by_up(plan, said, UpState(moves=(("c", "s"),))) is plan
    (line,) = said.lines
    assert line.startswith(f"warn `tfcluster up` started c's tasks on spare s (local state), but {why}: "
                           "that move is ignored"), line


def test_the_state_up_leaves_reads_back_and_an_older_one_still_reads():
    from tfcluster.launch.cluster.state import UpState

    now = UpState(name="t", spec_sha256="ab", run_id="up-1", tasks={"ps:0": {"host": "z", "tag": "t@1:up-1:ps:0:server"}},
                  hosts={"z": ["t@1:up-1:ps:0:server"]}, moves=(("a", "z"),))
    assert UpState.from_doc(json.loads(json.dumps(now.to_doc()))) == now
    assert now.to_doc()["moves"] == [{"lost": "a", "to": "z"}]
    older = {"name": "t", "spec_sha256": "ab", "run_id": "up-1",       # before `hosts` and `moves`
             "tasks": {"ps:0": {"host": "a", "tag": "x"}, "worker:0": {"host": "b", "tag": "y"}, "bad": 3}}
    read = UpState.from_doc(older)
    assert read.hosts == {"a": ["x"], "b": ["y"]} and read.moves == () and set(read.tasks) == {"ps:0", "worker:0"}
    assert UpState.from_doc({"moves": [{"lost": "a"}, "a->z", {"lost": "a", "to": "z"}]}).moves == (("a", "z"),)
    assert UpState.from_doc([1, 2]) == UpState()

"""The command line as a user meets it: exit codes, clean errors, fast imports."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import psutil
import pytest

from tests.helpers import GPU_LAB, LOCAL, local_spec, read_until, start_tfcluster, tfc, tfcluster, wait_for


def test_version_and_help_exit_0_and_help_has_an_example_per_command():
    assert tfc("--version").stdout.strip().startswith("tfcluster ")
    top = tfc("--help")
    assert top.returncode == 0
    for command in ("plan", "up", "down", "status", "train", "logs", "runs", "plot", "exec", "init", "render"):
        assert command in top.stdout
        sub = tfc(command, "--help")
        assert sub.returncode == 0, sub.stderr
        assert "Example:" in sub.stdout, command
        if command != "init":     # every command of a spec says what SPEC is
            assert re.search(r"\n  SPEC +Cluster spec \(YAML\), e\.g\. sample_clusters/local\.yaml", sub.stdout), command
    # an argument's own words (click 8.5 dropped typer's: pyproject's click bound)
    assert "[MODE]  between-graph | classic | coordinator | mirrored | keras-jax" in tfc("init", "--help").stdout


def test_plan_json_is_one_parseable_document_with_redacted_secrets():
    result = tfc("plan", GPU_LAB, "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["name"] == "lab" and len(doc["tasks"]) == 10
    assert len(doc["spec_sha256"]) == 64
    assert doc["tasks"][2]["env"]["WANDB_API_KEY"] == "***"
    assert "set-me" not in result.stdout + result.stderr


def test_plan_commands_shows_exact_command_and_redacts_secrets():
    result = tfc("plan", GPU_LAB, "--commands")
    assert result.returncode == 0, result.stderr
    assert "script:  /opt/venv/bin/python between_graph.py --steps 2000 --model_dir ~/.tfcluster/lab/ckpt " in result.stdout
    assert "WANDB_API_KEY='***'" in result.stdout
    assert "set-me" not in result.stdout
    # what only a run knows is named, not left out
    assert "  and at run time: TFCLUSTER_RUN_ID=<run id>, TFCLUSTER_RESTART=<restarts before>" in result.stdout
    # pasted into a shell, the line runs the argv the host's shim runs: `~/` words expanded
    # to that home (shim_tasks), the rest word for word
    line = next(x for x in result.stdout.splitlines() if x.startswith("  script:  "))
    shown = line[len("  script:  "):line.index("  (in ")]
    said = subprocess.run(["bash", "-c", f"printf '%s\\n' {shown}"], capture_output=True, text=True,
                          env={"HOME": "/home/me", "PATH": os.environ["PATH"]}, timeout=30).stdout.split("\n")[:-1]
    assert said == ["/opt/venv/bin/python", "between_graph.py", "--steps", "2000", "--model_dir",
                    "/home/me/.tfcluster/lab/ckpt"], said


def test_bad_spec_exits_2_with_one_line_naming_file_line_and_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nhosts:\n  - {name: a, address: 10.0.0.1}\njobs:\n"
                   "  ps: {count: 1, hosts: [a], port: 2222}\n  wroker: {count: 1, hosts: [a], port: 2223}\n")
    result = tfc("plan", str(bad))
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith(f"tfcluster: error: {bad}:6: jobs")
    assert "did you mean 'worker'" in lines[0]
    assert "Traceback" not in result.stderr
    # a word with no close choice: the choices said once, in the error line, with no hint
    # repeating them
    bad.write_text(bad.read_text().replace("wroker", "zzz"))
    lines = tfc("plan", str(bad)).stderr.strip().splitlines()
    assert lines == [f"tfcluster: error: {bad}:6: jobs.zzz: unknown job 'zzz'; expected one of: "
                     "chief, ps, worker, evaluator"], lines


def test_missing_spec_file_is_a_clean_error_and_debug_shows_the_traceback(tmp_path):
    result = tfc("plan", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "nope.yaml" in result.stderr
    debug = tfc("--debug", "plan", str(tmp_path / "nope.yaml"))
    # the traceback, then the same line and the same exit code: scripts that read the code
    # behave alike with and without it
    assert debug.returncode == 2 and "Traceback" in debug.stderr, debug.stderr
    assert debug.stderr.rstrip().splitlines()[-1] == result.stderr.rstrip().splitlines()[0]


def test_a_file_this_machine_refuses_is_one_line_not_a_traceback(tmp_path):
    """A directory that cannot be made (here in /proc, where mkdir answers ENOENT): what it
    was for, the path and the system's words, exit 4 as for any directory refused there. A
    full disk under stdout: the system's words, exit 1."""
    result = tfc("render", GPU_LAB, "--to", "slurm", "-o", "/proc/tfcluster-none/out")
    assert result.returncode == 4 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.rstrip().splitlines()[-1] == ("tfcluster: error: render -o: /proc/tfcluster-none: "
                                                       "cannot make this directory: No such file or directory"), result.stderr
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "tfcluster", "plan", LOCAL], stdout=full,
                                stderr=subprocess.PIPE, text=True, timeout=60)
    assert result.returncode == 1 and result.stderr == "tfcluster: error: No space left on device\n", result.stderr


def test_plan_allow_skew_without_check_is_refused_not_ignored():
    refused = tfc("plan", LOCAL, "--allow-skew")
    assert refused.returncode == 2 and refused.stdout == "", refused.stdout
    assert "plan --allow-skew: only --check compares the hosts' versions" in refused.stderr


def test_plan_to_slurm_checks_the_engine_first_and_its_json_holds_the_ranks():
    bad = tfc("plan", LOCAL, "--to", "tfjob")
    assert bad.returncode == 2 and bad.stdout == "", bad.stdout   # refused before any plan is printed
    result = tfc("plan", GPU_LAB, "--to", "slurm", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)      # one document, nothing after it
    slurm = doc["slurm"]
    assert slurm["nodes"] * slurm["tasks_per_node"] == len(slurm["ranks"])
    placed = {r["task"]: r for r in slurm["ranks"] if r["task"] is not None}
    assert set(placed) == {t["task"] for t in doc["tasks"]}
    assert all(isinstance(g, int) for r in slurm["ranks"] for g in r["gpus"])
    assert placed["worker:0"]["gpus"] == [0]


def test_down_and_drain_take_durations_as_up_and_train_do(tmp_path, home):
    # free ports, not the sample's: a cluster the person running the tests has up holds those
    spec = str(local_spec(tmp_path, name="local"))
    down = tfcluster("down", spec, "--grace", "2s", home=home, cwd=tmp_path)
    assert down.returncode == 0, down.stderr
    drain = tfcluster("drain", spec, "local", "--wait", "1m", home=home, cwd=tmp_path)
    assert drain.returncode == 1 and "no `tfcluster train` of cluster 'local' is running" in drain.stderr, drain.stderr
    bad = tfcluster("down", spec, "--grace", "soon", home=home, cwd=tmp_path)
    assert bad.returncode == 2 and "hint: see `tfcluster down --help`" in bad.stderr, bad.stderr


def test_a_hint_names_the_command_with_the_spec_it_was_given_quoted_for_a_shell(tmp_path, home):
    """`up` of a mode without servers points at `train` with this very spec, a path with a
    space quoted so the line pastes."""
    spec = tmp_path / "my lab.yaml"
    spec.write_text("name: m\nhosts: [{name: local, address: localhost}]\n"
                    "jobs: {worker: {count: 1, hosts: [local], port: 22230}}\n"
                    "train: {mode: mirrored, script: template:mirrored}\n")
    up = tfcluster("up", str(spec), home=home, cwd=tmp_path)
    assert up.returncode == 0, up.stderr
    assert f"nothing to start (`tfcluster train '{spec}'` starts the scripts)" in up.stdout + up.stderr


def test_unknown_command_and_unknown_option_exit_2_without_traceback():
    for args in (["frobnicate"], ["plan", LOCAL, "--jsno"]):
        result = tfc(*args)
        assert result.returncode == 2, args
        assert result.stderr.startswith("tfcluster: error:") and "Traceback" not in result.stderr


def test_a_mistyped_command_gets_one_suggestion():
    result = tfc("plna", LOCAL)
    assert result.returncode == 2
    assert result.stderr.splitlines()[0] == "tfcluster: error: No such command 'plna'. Did you mean 'plan'?"


def test_a_reader_that_leaves_early_is_not_an_error():
    """`plan --commands | head -1`: click turns the broken pipe into exit 1 unless we catch it."""
    shell = (f"{sys.executable} -m tfcluster plan {GPU_LAB} --commands | head -1 > /dev/null; "
             "echo rc=${PIPESTATUS[0]}")
    result = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "NO_COLOR": "1"})
    assert result.stdout.strip() == "rc=0" and result.stderr == "", (result.stdout, result.stderr)


def test_runs_logs_and_plot_name_a_runs_directory_they_cannot_list(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    for command in ("runs", "logs", "plot"):
        result = tfc(command, LOCAL, "--runs-dir", str(not_a_dir), cwd=str(tmp_path))
        assert result.returncode == 2, (command, result.stderr)
        assert result.stderr.startswith(f"tfcluster: error: runs directory {not_a_dir}: cannot list it: "
                                        "Not a directory\n"), result.stderr
        assert "Traceback" not in result.stderr


def test_plan_and_help_never_import_tensorflow_or_paramiko():
    code = (
        "import sys\n"
        "from tfcluster.cli import main\n"
        f"rc = main(['plan', {LOCAL!r}, '--json'])\n"
        "main(['--help'])\n"
        "heavy = [m for m in ('tensorflow', 'jax', 'keras', 'paramiko', 'rich', 'tfcluster.launch.cluster.session', 'tfcluster.launch.agent.agent') if m in sys.modules]\n"
        "print('HEAVY', heavy, rc)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "HEAVY [] 0" in result.stdout, result.stdout[-500:] + result.stderr[-500:]


def test_up_and_train_dry_run_touch_nothing(tmp_path):
    env_home = tmp_path / "home"
    env_home.mkdir()
    for command in ("up", "train"):
        result = subprocess.run([sys.executable, "-m", "tfcluster", command, LOCAL, "--dry-run"],
                                capture_output=True, text=True, timeout=60, cwd=tmp_path,
                                env={**os.environ, "HOME": str(env_home)})
        assert result.returncode == 0, result.stderr
        assert "worker:1" in result.stdout
    assert list(env_home.iterdir()) == [] and not (tmp_path / "runs").exists()


def test_exec_rejects_unknown_host_with_a_suggestion():
    result = tfc("exec", LOCAL, "--hosts", "locl", "--", "true")
    assert result.returncode == 2
    assert "did you mean 'local'" in result.stderr
    none = tfc("exec", LOCAL, "--hosts", " , ", "--", "true")    # not a run on no host, said as done
    assert none.returncode == 2 and "--hosts ' , ': names no host (hosts: local)" in none.stderr, none.stderr


def test_init_copies_a_template_and_refuses_to_overwrite(tmp_path):
    result = tfc("init", "mirrored", cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    written = tmp_path / "train_mirrored.py"
    assert "MultiWorkerMirroredStrategy" in written.read_text()
    assert "next: in your spec, `train: {mode: mirrored, script: train_mirrored.py}`" in result.stdout + result.stderr
    again = tfc("init", "mirrored", cwd=str(tmp_path))
    assert again.returncode == 2 and "already exists" in again.stderr
    (tmp_path / "scripts").mkdir()
    into = tfc("init", "mirrored", "scripts", cwd=str(tmp_path))       # a directory: the file goes in it
    assert into.returncode == 0 and (tmp_path / "scripts" / "train_mirrored.py").is_file(), into.stderr
    made = tfc("init", "classic", "new/", cwd=str(tmp_path))            # `new/`: a directory meant, made
    assert made.returncode == 0 and (tmp_path / "new" / "train_classic.py").is_file(), made.stderr
    deeper = tfc("init", "classic", "none/new/", cwd=str(tmp_path))     # only the last level is made
    assert deeper.returncode == 2 and deeper.stderr.splitlines()[0] == (
        "tfcluster: error: cannot make directory none/new/: No such file or directory"), deeper.stderr
    misspelt = tfc("init", "mirrorred", cwd=str(tmp_path))
    assert misspelt.returncode == 2 and "did you mean 'mirrored'?" in misspelt.stderr, misspelt.stderr
    # the template's file name given for its mode: the mode it meant
    typo = tfc("init", "between_graph", cwd=str(tmp_path))
    assert typo.returncode == 2 and "unknown mode 'between_graph'; did you mean 'between-graph'?" in typo.stderr


def test_task_filter_is_checked_by_dry_run_too(tmp_path):
    """`train --dry-run --task X` said nothing of a task the spec lacks; the run itself refused it."""
    bad = tfc("train", LOCAL, "--dry-run", "--task", "wroker:1", cwd=str(tmp_path))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    assert bad.stderr.splitlines()[0] == ("tfcluster: error: --task wroker:1: no such task (tasks: ps:0, "
                                          "worker:0, worker:1); did you mean 'worker:1'?"), bad.stderr
    assert tfc("train", LOCAL, "--dry-run", "--task", "worker:1", cwd=str(tmp_path)).returncode == 0


def test_script_flag_without_double_dash_gets_a_hint():
    result = tfc("train", LOCAL, "--steps", "100")
    assert result.returncode == 2
    assert "tfcluster train SPEC -- --steps 100" in result.stderr


def test_a_word_after_the_spec_without_dashes_is_refused_not_handed_to_the_script(tmp_path, home):
    """`tfcluster train lab.yaml train.py`, as one types `python train.py`: refused, exit 2,
    nothing started; the words after `--` (and only those) are the script's."""
    stray = tfcluster("train", LOCAL, "train.py", home=home, cwd=tmp_path)
    assert stray.returncode == 2, stray.stderr
    assert stray.stderr.splitlines() == [
        "tfcluster: error: train: unexpected 'train.py' after the spec; the script's arguments go after `--`",
        "hint: `tfcluster train SPEC -- train.py` passes them to the script (replacing train.args); "
        "`--script FILE` runs another script"]
    before = tfcluster("train", LOCAL, "foo", "--dry-run", "--", "--steps", "5", home=home, cwd=tmp_path)
    assert before.returncode == 2 and "unexpected 'foo'" in before.stderr, before.stderr
    dashed = tfcluster("train", LOCAL, "--dry-run", "--", "--steps", "5", "--", "x", home=home, cwd=tmp_path)
    assert dashed.returncode == 0, dashed.stderr
    assert "between_graph.py --steps 5 -- x  (in " in dashed.stdout
    assert list(home.iterdir()) == [] and not (tmp_path / "runs").exists()


def _spec_with_script(tmp_path, args: str = "[]") -> tuple[str, str]:
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    spec = tmp_path / "moved.yaml"
    spec.write_text("name: moved\nhosts:\n  - {name: local, address: 127.0.0.1}\n"
                    "jobs:\n  ps: {tasks: ['local:29991']}\n  worker: {tasks: ['local:29992']}\n"
                    f"train:\n  script: train.py\n  args: {args}\n  timeout: 90s\n"
                    "  restart: {policy: exit-code, max_restarts: 2}\n")
    return str(spec), str(script)


def test_a_moved_script_only_stops_train_not_plan_or_logs(tmp_path):
    spec, script = _spec_with_script(tmp_path)
    os.unlink(script)
    assert tfc("plan", spec).returncode == 0
    logs = tfc("logs", spec, cwd=str(tmp_path))
    assert logs.returncode == 2 and "no saved runs of cluster 'moved'" in logs.stderr
    train = tfc("train", spec, "--dry-run")
    assert train.returncode == 2
    assert f"moved.yaml:8: train.script: file not found: {tmp_path}/train.py" in train.stderr


def test_script_arguments_on_the_command_line_follow_the_spec_placeholder_rules(tmp_path):
    spec, _ = _spec_with_script(tmp_path)
    bad = tfc("train", spec, "--dry-run", "--", "--index={index:>3}")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "script argument 1 ('--index={index:>3}')" in bad.stderr and "unknown placeholder" in bad.stderr
    good = tfc("train", spec, "--dry-run", "--", "--index={index}")
    assert good.returncode == 0, good.stderr
    assert "--index=0" in good.stdout


def test_plan_json_shows_restart_timeout_and_exact_commands(tmp_path):
    spec, _ = _spec_with_script(tmp_path)
    doc = json.loads(tfc("plan", spec, "--json").stdout)
    assert doc["restart"] == {"policy": "exit-code", "max_restarts": 2}
    assert doc["timeout"] == 90.0
    worker = next(t for t in doc["tasks"] if t["task"] == "worker:0")
    assert worker["script"] == [sys.executable, "train.py"]   # a local host runs our interpreter
    assert worker["server_command"][0] == sys.executable
    assert doc["hosts"] == [{"name": "local", "address": "127.0.0.1", "local": True, "gpus": 0,
                             "python": sys.executable, "preemptible": "no", "metadata_url": None}]


def test_run_summary_keeps_the_start_of_a_long_line_and_marks_the_cut():
    import io

    from tfcluster.ui import UI
    from tfcluster.ui.views import print_summary

    err = io.StringIO()
    ui = UI(io.StringIO(), err, color=False)
    line = "worker=0 global_step=299 loss=0.0123 " + "x" * 100
    print_summary(ui, "r1", [("worker:0", "local", "0", "0", "1.0s", line)], (0, "succeeded"), "runs/r1")
    text = err.getvalue()
    assert "worker=0 global_step=299 loss=0.0123" in text and "…" in text
    assert "x" * 100 not in text and "succeeded — logs in runs/r1/" in text


def test_a_ctrl_c_of_exec_is_said_interrupted_and_stops_the_command(tmp_path, home):
    spec = local_spec(tmp_path, name="exint")
    pid_file = tmp_path / "command.pid"
    proc = start_tfcluster("exec", str(spec), "--", "sh", "-c", f"echo $$ > {pid_file}; echo started; exec sleep 60",
                           home=home, cwd=tmp_path)
    try:
        read_until(proc, r"started", timeout=30)
        command = int(pid_file.read_text())
        os.killpg(proc.pid, signal.SIGINT)
        out = proc.communicate(timeout=30)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and "tfcluster: error: interrupted" in out and "Traceback" not in out, out
    wait_for(lambda: not psutil.pid_exists(command) or psutil.Process(command).status() == psutil.STATUS_ZOMBIE,
             timeout=10, what="the command stopped")


def test_exec_counts_a_signal_as_a_failure_ends_stdin_and_runs_a_repeated_host_once(tmp_path):
    spec = tmp_path / "ex.yaml"
    spec.write_text("name: exsig\nhosts:\n  - {name: a, address: localhost}\n  - {name: b, address: 127.0.0.1}\n"
                    "jobs:\n  worker: {tasks: ['a:32230', 'b:32231']}\ntrain: {mode: mirrored}\n")
    # one of the two hosts (the same machine) is killed, the other exits 0: the worst counts
    lock = tmp_path / "lock"
    killed = tfc("exec", str(spec), "--", "sh", "-c", f"if mkdir {lock}; then kill -9 $$; fi; echo fine",
                 cwd=str(tmp_path))
    assert killed.returncode == 137, (killed.returncode, killed.stderr)    # was 0
    assert "exit code 137 (128 + SIGKILL: the command was killed by that signal, or exited with this code)" \
        in killed.stderr and killed.stdout.count("fine") == 1, killed.stderr
    # a command's own `exit 130` is its status, not a Ctrl-C of tfcluster's (was "killed by signal
    # 2" and "error: interrupted")
    # a command the host lacks is said so in tfcluster's words (was setsid's "failed to execute")
    missing = tfc("exec", str(spec), "--hosts", "a", "--", "no-such-command-xyz", cwd=str(tmp_path))
    assert missing.returncode == 127, missing.stderr
    assert "a │ tfcluster: command not found: no-such-command-xyz" in missing.stdout, missing.stdout
    empty = tfc("exec", str(spec), "--", "", cwd=str(tmp_path))
    assert empty.returncode == 2 and "exec: the command is an empty word" in empty.stderr, empty.stderr
    own = tfc("exec", str(spec), "--hosts", "a", "--", "sh", "-c", "exit 130", cwd=str(tmp_path))
    assert own.returncode == 130 and "interrupted" not in own.stderr, own.stderr
    assert "host a: exit code 130 (128 + SIGINT: " in own.stderr, own.stderr
    # a command reading stdin sees its end (it waited forever on a pipe held open)
    cat = tfc("exec", str(spec), "--hosts", "a", "--", "cat", timeout=60)
    assert cat.returncode == 0 and cat.stdout == "", (cat.returncode, cat.stderr)
    once = tfc("exec", str(spec), "--hosts", "a,a", "--", "echo", "hi")
    assert once.returncode == 0 and once.stdout.count("hi") == 1, once.stderr    # was a traceback


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM])
def test_exec_interrupted_stops_the_command_it_started(tmp_path, home, how):
    """Ctrl-C (the terminal's group gets SIGINT) or a SIGTERM while `exec` runs a long command:
    exit 130 or 143, and the command is gone too, not left running without its launcher (a
    command with no terminal is sent no signal when its channel closes)."""
    marker = f"{tmp_path}/exec-marker-{how}"     # the command's $0: its process is found by it
    proc = start_tfcluster("exec", LOCAL, "--", "sh", "-c", "echo started; sleep 1000; :", marker,
                           home=home, cwd=tmp_path)
    try:
        read_until(proc, r"local │ started", timeout=30)
        # settled: the one command, its sleep exec'd (a fork not yet exec'd has its words)
        wait_for(lambda: len(_running(marker)) == 1 and _asleep(_running(marker)[0]), timeout=10,
                 what="the command running, its sleep too")
        (command,) = _running(marker)
        started = [psutil.Process(command), *psutil.Process(command).children()]
        if how == signal.SIGINT:
            os.killpg(proc.pid, how)
        else:
            proc.send_signal(how)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + how
    wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in started),
             timeout=10, what="the command and its child stopped with exec")


def _asleep(pid: int) -> bool:
    try:
        return [c.name() for c in psutil.Process(pid).children()] == ["sleep"]
    except psutil.Error:
        return False


def _running(marker: str) -> list[int]:
    """The command exec runs (the launcher and the wrapper have the marker among their words too)."""
    command = ["sh", "-c", "echo started; sleep 1000; :", marker]
    return [p.pid for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == command]


def test_render_to_a_file_is_a_bad_command_line_and_writes_nothing(tmp_path):
    spec = tmp_path / "local.yaml"
    spec.write_bytes(open(LOCAL, "rb").read())
    result = tfc("render", str(spec), "--to", "slurm", "-o", str(spec))
    assert result.returncode == 2, result.stderr
    assert result.stderr.rstrip().splitlines()[-1] == (f"tfcluster: error: -o {spec}: not a directory (render "
                                                       f"writes its files into one: local.sbatch)"), result.stderr
    assert spec.read_bytes() == open(LOCAL, "rb").read() and sorted(os.listdir(tmp_path)) == ["local.yaml"]


def test_render_to_a_directory_prints_a_next_step_that_works_from_here(tmp_path):
    out = tmp_path / "k8s dir"
    result = tfc("render", LOCAL, "--to", "tfjob", "--image", "tf:1", "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert f"next: cd '{out}' && kubectl apply --server-side -f local-tfjob.yaml" in result.stderr
    slurm = tfc("render", LOCAL, "--to", "slurm", "--image", "tf:1", "-o", str(tmp_path / "sl"))
    assert slurm.returncode == 0 and "--image is for --to tfjob; ignored for --to slurm" in slurm.stderr


def test_a_local_python_that_does_not_exist_is_a_preflight_error_naming_it(tmp_path):
    spec = tmp_path / "py.yaml"
    spec.write_text("name: nopy\npython: /nonexistent/bin/python3\nhosts:\n  - {name: local, address: 127.0.0.1}\n"
                    "jobs:\n  ps: {tasks: ['local:32239']}\n  worker: {tasks: ['local:32240']}\n")
    (tmp_path / "home").mkdir()
    result = subprocess.run([sys.executable, "-m", "tfcluster", "up", str(spec)], capture_output=True, text=True,
                            timeout=60, cwd=tmp_path, env={**os.environ, "HOME": str(tmp_path / "home")})
    assert result.returncode == 4, result.stderr                         # was 1, FileNotFoundError
    assert "tfcluster: error: host local: /nonexistent/bin/python3 not found" in result.stderr


def test_timeout_options_take_the_durations_the_spec_takes(tmp_path):
    from tfcluster.cli.app import seconds

    assert [seconds(t) for t in ("25", "90s", "1.5m", "2h")] == [25.0, 90.0, 90.0, 7200.0]
    for command in ("up", "train"):
        ok = tfc(command, LOCAL, "--dry-run", "--timeout", "90s", cwd=str(tmp_path))
        assert ok.returncode == 0, ok.stderr
        bad = tfc(command, LOCAL, "--dry-run", "--timeout", "10x", cwd=str(tmp_path))
        assert bad.returncode == 2 and "Traceback" not in bad.stderr
        assert bad.stderr.splitlines()[0] == ("tfcluster: error: Invalid value for '--timeout': '10x': must be "
                                              "a positive number of seconds or a duration like 90s, 30m, 2h "
                                              "(at most 8784h, a year)")
    # past a year every timer tfcluster sets overflows (a traceback before the bound)
    assert seconds("8784h") == 8784 * 3600.0
    huge = tfc("train", LOCAL, "--dry-run", "--timeout", "99999999999h", cwd=str(tmp_path))
    assert huge.returncode == 2 and "Traceback" not in huge.stderr
    assert "'99999999999h': must be a positive number" in huge.stderr.splitlines()[0], huge.stderr


def test_status_watch_interval_is_a_duration_with_a_floor(tmp_path, home):
    """`--interval 2s` as every other time option takes it; one too short (a busy loop of
    round trips) or too long (time.sleep overflowed: a traceback) is a usage error."""
    for interval, said in (("1e308", "'1e308': must be a positive number"),
                           ("99999999999h", "'99999999999h': must be a positive number"),
                           ("0.01", "--interval 0.01s: must be at least 0.2s")):
        bad = tfcluster("status", LOCAL, "--watch", "--interval", interval, home=home, cwd=tmp_path)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
        assert said in bad.stderr.splitlines()[0], bad.stderr


def test_a_signal_that_python_wraps_while_a_class_is_made_is_still_a_clean_stop():
    """A Ctrl-C or SIGTERM landing in a dataclass field's __set_name__ (a module imported on
    first use, the SSH transport's at the first connection) comes out of Python 3.11 as a
    RuntimeError: still exit 130 (143), one line, no traceback. The class is made for real;
    only the moment of the signal is injected (it cannot be timed)."""
    code = (
        "import sys\n"
        "import tfcluster.cli.cluster as commands\n"
        "from tfcluster.cli import main\n"
        "from tfcluster.errors import Terminated\n"
        "signal = {'int': KeyboardInterrupt, 'term': Terminated}[sys.argv[1]]\n"
        "class Lands:\n"
        "    def __set_name__(self, owner, name):\n"
        "        raise signal()\n"
        "def load(*args, **kwargs):\n"
        "    class Connection:\n"
        "        proxy = Lands()\n"
        "commands.load = load\n"
        f"sys.exit(main(['plan', {LOCAL!r}]))\n"
    )
    for which, rc, said in (("int", 130, "interrupted"), ("term", 143, "terminated (SIGTERM)")):
        result = subprocess.run([sys.executable, "-c", code, which], capture_output=True, text=True, timeout=60)
        assert result.returncode == rc, result.stdout[-500:] + result.stderr[-2000:]
        assert f"tfcluster: error: {said}" in result.stderr and "Traceback" not in result.stderr, result.stderr

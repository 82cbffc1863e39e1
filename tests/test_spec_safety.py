"""Issue 10, parts 5, 7 and 8: the files a run ships, secrets, and limits against blow-ups.

Loader-level tests (no TensorFlow, no network), exact messages, plus `plan`/`train
--dry-run` through the CLI where the exit code and the absence of a traceback matter.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tfcluster.errors import SpecError, UsageError
from tfcluster.launch.cluster import shipping
from tfcluster.plan import build_plan, plan_to_dict
from tfcluster.spec import check_train_files, is_secret, load_spec, with_train_overrides
from tfcluster.spec import shipped as shipped_module

HEAD = """\
name: s
hosts:
  - {name: a, address: 10.0.0.1}
jobs:
  ps: {count: 1, hosts: [a], port: 2222}
  worker: {count: 2, hosts: [a], port: 2300}
"""                 # lines 1-6; anything appended starts on line 7


def tfc(*args: str, cwd: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tfcluster", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**os.environ, "NO_COLOR": "1"})


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """proj/ (the spec's directory) with a script and data, and outside/ next to it."""
    proj, outside = tmp_path / "proj", tmp_path / "outside"
    (proj / "data" / "deep").mkdir(parents=True)
    outside.mkdir()
    (proj / "train.py").write_text("print('hi')\n")
    (proj / "data" / "a.csv").write_text("1,2\n")
    (proj / "data" / "deep" / "b.csv").write_text("3\n")
    (outside / "id_rsa").write_text("PRIVATE\n")
    (outside / "train.py").write_text("other\n")
    return proj


def spec_in(proj: Path, train: str, head: str = HEAD) -> str:
    path = proj / "s.yaml"
    path.write_text(head + "train:\n  script: train.py\n" + train)
    return str(path)


def refusal(path: str) -> SpecError:
    spec = load_spec(path)
    with pytest.raises(SpecError) as info:
        check_train_files(spec)
    assert len(str(info.value).splitlines()) == 1
    return info.value


# ------------------------------------------------------------------ part 5: what ships

def test_the_listing_is_every_file_with_its_place_in_the_run_dir_and_its_size(tree):
    (tree / "latest").symlink_to("data/a.csv")          # a link inside the tree keeps its name
    path = spec_in(tree, "  files: [data, latest, ../outside/id_rsa]\n  allow_outside: [../outside]\n")
    files = check_train_files(load_spec(path))
    out = str(tree.parent / "outside")
    assert files == (
        (str(tree / "train.py"), "train.py", 12),
        (str(tree / "data" / "a.csv"), "data/a.csv", 4),
        (str(tree / "data" / "deep" / "b.csv"), "data/deep/b.csv", 2),
        (str(tree / "data" / "a.csv"), "latest", 4),
        (f"{out}/id_rsa", "id_rsa", 8),                  # from elsewhere: under its own name
    )
    plan = build_plan(load_spec(path), files=files)
    assert [(c[0], c[1]) for c in shipping.collect_files(plan)] == [
        ("train.py", b"print('hi')\n"), ("data/a.csv", b"1,2\n"), ("data/deep/b.csv", b"3\n"),
        ("latest", b"1,2\n"), ("id_rsa", b"PRIVATE\n")]
    assert plan_to_dict(plan)["files"][1] == {"path": str(tree / "data" / "a.csv"), "to": "data/a.csv",
                                              "bytes": 4}


# (id, lines after `script:` (line 8), "LINE: field: problem" after "FILE:"; {p} the spec's dir, {o} outside/)
REFUSED = [
    ("absolute-outside", "  files: [/etc/hostname]\n",
     "9: train.files[0]: /etc/hostname is outside the spec's directory ({p})"),
    ("dotdot", "  files: [train.py, ../outside/id_rsa]\n",
     "9: train.files[1]: {o}/id_rsa is outside the spec's directory ({p})"),
    ("link-to-outside", "  files: [key.txt]\n",
     "9: train.files[0]: {p}/key.txt resolves to {o}/id_rsa, outside the spec's directory ({p})"),
    ("link-inside-a-dir", "  files: [data]\n",
     "9: train.files[0]: {p}/data/leak resolves to {o}/id_rsa, outside the spec's directory ({p})"),
    ("dir-link-inside-a-dir", "  files: [tree]\n",
     "9: train.files[0]: {p}/tree/up is a symbolic link to a directory, which is not followed"),
    ("dev-zero", "  files: [/dev/zero]\n  allow_outside: [/dev]\n",
     "9: train.files[0]: /dev/zero is a character device; only regular files and directories are shipped"),
    ("fifo", "  files: [pipe]\n",
     "9: train.files[0]: {p}/pipe is a FIFO; only regular files and directories are shipped"),
    ("fifo-in-a-dir", "  files: [tree2]\n",
     "9: train.files[0]: {p}/tree2/pipe is a FIFO; only regular files and directories are shipped"),
    ("same-place-twice", "  files: [../outside/train.py]\n  allow_outside: [../outside]\n",
     "9: train.files[0]: {o}/train.py and {p}/train.py would both be train.py in the run directory"),
    ("file-and-dir", "  files: [data/a.csv, ../outside/data]\n  allow_outside: [../outside]\n",
     "9: train.files[1]: data would be both a file and a directory in the run directory"),
    ("allow-not-a-dir", "  files: [data]\n  allow_outside: [nope]\n",
     "10: train.allow_outside[0]: not a directory: {p}/nope"),
    ("outside-with-allow-elsewhere", "  files: [/etc/hostname]\n  allow_outside: [../outside]\n",
     "9: train.files[0]: /etc/hostname is outside the spec's directory and train.allow_outside ({p})"),
]


@pytest.mark.parametrize("lines,expected", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_refused_before_anything_is_read_with_one_exact_line(tree, lines, expected):
    outside = tree.parent / "outside"
    (tree / "key.txt").symlink_to(outside / "id_rsa")
    (tree / "data" / "leak").symlink_to(outside / "id_rsa")
    (tree / "tree").mkdir()
    (tree / "tree" / "up").symlink_to(tree / "data")
    os.mkfifo(tree / "pipe")
    (tree / "tree2").mkdir()
    os.mkfifo(tree / "tree2" / "pipe")
    (outside / "data").write_text("a file\n")
    path = spec_in(tree, lines)
    error = refusal(path)
    assert str(error) == f"{path}:" + expected.replace("{p}", str(tree)).replace("{o}", str(outside))


def test_sizes_come_from_stat_so_a_huge_file_is_refused_at_once(tree, monkeypatch):
    with open(tree / "huge.bin", "wb") as f:
        f.truncate(300 << 20)                    # sparse: 300 MiB by stat, nothing on disk
    path = spec_in(tree, "  files: [huge.bin]\n")
    started = time.monotonic()
    error = refusal(path)
    assert time.monotonic() - started < 2
    assert str(error) == (f"{path}:9: train.files[0]: {tree}/huge.bin is {300 << 20} bytes and brings "
                          f"what a run ships to {(300 << 20) + 12}; at most {256 << 20} (256 MiB)")
    assert error.hint == "put data on the hosts instead"
    monkeypatch.setattr(shipped_module, "MAX_SHIP_FILES", 3)
    error = refusal(spec_in(tree, "  files: [data]\n"))
    assert str(error).endswith(f"train.files[0]: more than 3 files and directories to ship "
                               f"(at {tree}/data/deep/b.csv)")


def test_a_file_that_changed_after_the_check_is_not_shipped(tree):
    path = spec_in(tree, "  files: [data]\n")
    plan = build_plan(load_spec(path), files=check_train_files(load_spec(path)))
    (tree / "data" / "a.csv").write_text("1,2,3\n")
    with pytest.raises(UsageError, match=r"a.csv changed since it was checked \(4 bytes then\)"):
        shipping.collect_files(plan)
    (tree / "data" / "a.csv").unlink()
    (tree / "data" / "a.csv").symlink_to(tree.parent / "outside" / "id_rsa")
    with pytest.raises(UsageError, match=r"cannot read .*a.csv: Too many levels of symbolic links"):
        shipping.collect_files(plan)
    with pytest.raises(UsageError, match="the plan lists no files to ship"):
        shipping.collect_files(build_plan(load_spec(path)))


def test_a_command_line_script_and_a_template_are_not_held_to_the_spec_directory(tree):
    spec = with_train_overrides(load_spec(spec_in(tree, "")), script=str(tree.parent / "outside" / "train.py"))
    assert check_train_files(spec) == ((str(tree.parent / "outside" / "train.py"), "train.py", 6),)
    path = tree / "t.yaml"
    path.write_text(HEAD + "train: {script: 'template:mirrored'}\n")
    (((source, dest, size),)) = check_train_files(load_spec(str(path)))
    assert dest == "mirrored.py" and size == os.path.getsize(source)


def test_plan_lists_what_ships_and_train_refuses_before_connecting(tree):
    path = spec_in(tree, "  files: [data]\n")
    text = tfc("plan", path)
    assert text.returncode == 0, text.stderr
    assert "ships 3 file(s), 18 B, into each script host's run directory:" in text.stdout
    assert f"  {tree}/data/deep/b.csv → data/deep/b.csv (2 B)" in text.stdout
    doc = json.loads(tfc("plan", path, "--json").stdout)
    assert [f["to"] for f in doc["files"]] == ["train.py", "data/a.csv", "data/deep/b.csv"]
    assert doc["files_problem"] is None
    bad = spec_in(tree, "  files: [../outside/id_rsa]\n")
    shown = tfc("plan", bad)            # plan shows the refusal and still exits 0
    assert shown.returncode == 0 and "ships" not in shown.stdout
    assert (f"tfcluster: warning: train would refuse this spec: {bad}:9: train.files[0]: "
            f"{tree.parent}/outside/id_rsa is outside the spec's directory ({tree})") in shown.stderr
    assert json.loads(tfc("plan", bad, "--json").stdout)["files"] == []
    train = tfc("train", bad)           # the hosts (10.0.0.1) are never dialled
    assert train.returncode == 2 and train.stdout == ""
    assert train.stderr.splitlines()[0] == (f"tfcluster: error: {bad}:9: train.files[0]: "
                                            f"{tree.parent}/outside/id_rsa is outside the spec's "
                                            f"directory ({tree})")
    assert "Traceback" not in train.stderr


def one_local_worker(name: str) -> str:
    """A spec's head: cluster `name`, one worker on this machine (its train: follows)."""
    from tests.tf_launch import free_ports

    return (f"name: {name}\nhosts: [{{name: local, address: localhost}}]\n"
            f"jobs: {{worker: {{count: 1, hosts: [local], port: {free_ports(1)[0]}}}}}\n")


def test_a_module_the_script_imports_from_beside_it_unshipped_is_said_before_and_its_failure_named(tmp_path, home):
    """The multi-worker tutorial's `import mnist_setup` (and a package beside it), with no
    train.files: plan and train warn before anything runs, naming each import's line, and the
    failed import's hint is the files: line that fixes it; shipped, it trains."""
    from tests.helpers import tfcluster

    (tmp_path / "main.py").write_text("import os\nimport mnist_setup\nfrom helpers.x import y\nimport json\n"
                                      "print('ok', mnist_setup.N, y, flush=True)\n")
    (tmp_path / "mnist_setup.py").write_text("N = 3\n")
    (tmp_path / "helpers").mkdir()
    (tmp_path / "helpers" / "__init__.py").write_text("")
    (tmp_path / "helpers" / "x.py").write_text("y = 1\n")
    spec, head = tmp_path / "s.yaml", one_local_worker("unship")
    spec.write_text(head + "train: {mode: mirrored, script: main.py}\n")
    said = ("main.py:2 imports mnist_setup (" + str(tmp_path / "mnist_setup.py") + "); main.py:3 imports helpers ("
            + str(tmp_path / "helpers") + "), which train.files does not ship: a host imports it only where it "
            "is installed; to ship it, add it to train.files (files: [mnist_setup.py, helpers])")

    plan = tfcluster("plan", str(spec), home=home, cwd=tmp_path)
    train = tfcluster("train", str(spec), home=home, cwd=tmp_path, timeout=120)

    assert plan.returncode == 0 and f"tfcluster: warning: {said}" in plan.stderr, plan.stderr
    assert train.returncode == 5 and f"tfcluster: warning: {said}" in train.stderr, train.stderr[-2000:]
    assert train.stderr.rstrip().endswith(f"hint: mnist_setup.py is here ({tmp_path / 'mnist_setup.py'}) but was "
                                          "not shipped: add it to train.files (files: [mnist_setup.py])")
    spec.write_text(head + "train: {mode: mirrored, script: main.py, files: [mnist_setup.py, helpers]}\n")
    shipped = tfcluster("train", str(spec), home=home, cwd=tmp_path, timeout=120)
    assert shipped.returncode == 0 and "worker:0 │ ok 3 1" in shipped.stdout, shipped.stderr[-2000:]
    assert "does not ship" not in shipped.stderr


def test_a_script_in_a_subdirectory_imports_the_modules_shipped_beside_it(tmp_path, home):
    """TensorFlow's tutorial kept in a folder of its own: `script: tutorial/main.py` lands as
    tutorial/main.py in the run directory and runs there as `python tutorial/main.py` does here,
    so `import mnist_setup` finds tutorial/mnist_setup.py; unshipped, the entry to add is the
    one relative to the spec."""
    from tests.helpers import tfcluster

    (tmp_path / "tutorial").mkdir()
    (tmp_path / "tutorial" / "main.py").write_text("import os\nimport mnist_setup\nprint('ok', mnist_setup.N, flush=True)\n")
    (tmp_path / "tutorial" / "mnist_setup.py").write_text("N = 3\n")
    spec, head = tmp_path / "s.yaml", one_local_worker("subdir")
    spec.write_text(head + "train: {mode: mirrored, script: tutorial/main.py}\n")
    plan = tfcluster("plan", str(spec), home=home, cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    assert ("tutorial/main.py:2 imports mnist_setup (" + str(tmp_path / "tutorial" / "mnist_setup.py") + "), which "
            "train.files does not ship") in plan.stderr, plan.stderr
    assert "add it to train.files (files: [tutorial/mnist_setup.py])" in plan.stderr, plan.stderr
    spec.write_text(head + "train: {mode: mirrored, script: tutorial/main.py, files: [tutorial/mnist_setup.py]}\n")
    shipped = tfcluster("train", str(spec), home=home, cwd=tmp_path, timeout=120)
    assert shipped.returncode == 0 and "worker:0 │ ok 3" in shipped.stdout, shipped.stdout[-2000:] + shipped.stderr[-2000:]
    assert "does not ship" not in shipped.stderr


# ------------------------------------------------------------------ part 7: secrets

@pytest.mark.parametrize("name", ["DB_PASS", "MYSQL_PWD", "MY_PASSWORD", "PASSWD", "GH_AUTH",
                                  "SSH_PRIVATE_KEY", "AWS_CREDENTIALS", "API_TOKEN", "APP_SECRET",
                                  "WANDB_API_KEY", "db_pass", "Auth_Header"])
def test_the_secret_name_rule_covers_the_common_spellings(name):
    assert is_secret(name)


@pytest.mark.parametrize("name", ["PATH", "HOME", "LANG", "DATA_DIR", "TF_CPP_MIN_LOG_LEVEL"])
def test_ordinary_names_are_shown(name):
    assert not is_secret(name)


ENV = """\
env:
  DB_URL: postgres://u:pw@db/x
  KEYBOARD_LAYOUT: us-intl
  DB_PASS: hunter22
  PIN_KEY: abc
secret_env: [DB_URL]
public_env: [KEYBOARD_LAYOUT]
"""


def test_secret_env_marks_and_public_env_unmarks_everywhere_a_plan_is_shown(tmp_path):
    path = tmp_path / "e.yaml"
    path.write_text(HEAD + ENV)
    plan = build_plan(load_spec(str(path)))
    env = plan_to_dict(plan)["tasks"][0]["env"]        # --json and the manifest
    assert (env["DB_URL"], env["DB_PASS"], env["KEYBOARD_LAYOUT"], env["PIN_KEY"]) == ("***", "***", "us-intl", "***")
    assert dict(plan.task("ps:0").env)["DB_URL"] == "postgres://u:pw@db/x"   # the task still gets it
    commands = tfc("plan", str(path), "--commands")
    assert commands.returncode == 0, commands.stderr
    assert "DB_URL='***'" in commands.stdout and "KEYBOARD_LAYOUT=us-intl" in commands.stdout
    assert "postgres" not in commands.stdout + commands.stderr and "hunter22" not in commands.stdout


@pytest.mark.parametrize("extra,expected", [
    ("secret_env: [DB_UR]\n", "8: secret_env[0]: 'DB_UR' is not set in env; did you mean 'DB_URL'?"),
    ("public_env: [DB_URL]\n", "8: public_env[0]: DB_URL is shown anyway: public_env only un-marks "
                               "names containing PASS, PWD, AUTH, PRIVATE, CREDENTIAL, TOKEN, SECRET, KEY, "
                               "DSN, WEBHOOK, COOKIE, SESSION"),
    ("secret_env: [DB_PASS]\npublic_env: [DB_PASS]\n", "9: public_env[0]: DB_PASS is also listed in secret_env"),
    ("train:\n  args: [--db, 'x-hunter22-y']\n",
     "9: train.args[1]: contains the value of secret env DB_PASS; script arguments are visible in `ps` "
     "on every host"),
])
def test_secret_lists_and_args_with_a_secret_are_refused_with_one_line(tmp_path, extra, expected):
    path = tmp_path / "e.yaml"
    path.write_text(HEAD + "env: {DB_URL: u, DB_PASS: hunter22}\n" + extra)
    with pytest.raises(SpecError) as info:
        load_spec(str(path))
    assert str(info.value) == f"{path}:" + expected


def test_an_arg_with_a_secret_is_refused_from_the_command_line_too_and_short_values_are_not_matched(tmp_path):
    path = tmp_path / "e.yaml"
    path.write_text(HEAD + ENV + "train:\n  args: ['--layout=us-intl', '--pin=abc']\n")   # public; < 4 chars
    spec = load_spec(str(path))
    with pytest.raises(UsageError) as info:
        with_train_overrides(spec, args=["--steps", "5", "--db=postgres://u:pw@db/x"])
    assert str(info.value) == ("script argument 3: contains the value of secret env DB_URL; script "
                               "arguments are visible in `ps` on every host")
    assert info.value.hint == ("read it in the script from the environment (os.environ['DB_URL']); "
                               "if DB_URL is not secret, list it in public_env")
    assert with_train_overrides(spec, args=["--pin", "abc"]).train.args == ("--pin", "abc")


# ------------------------------------------------------------------ part 8: limits

def _workers(n: int, extra: str = "") -> str:
    return ("name: big\nhosts:\n" + "".join(f"  - {{name: h{i}, address: 10.0.0.{i + 1}}}\n" for i in range(8))
            + "jobs:\n  ps: {count: 1, hosts: [h0], port: 2000}\n"
            + f"  worker: {{count: {n}, hosts: [h0, h1, h2, h3, h4, h5, h6, h7], port: 3000}}\n" + extra)


@pytest.mark.parametrize("text,expected", [
    (HEAD + "env:\n" + "".join(f"  V{i}: x\n" for i in range(1001)), "7: env: 1001 entries; at most 1000"),
    (HEAD + f"env: {{BIG: {'x' * (128 << 10)}}}\n",
     f"7: env.BIG: BIG=VALUE is {(128 << 10) + 4} bytes; one environment string may be at most 131072 "
     "(execve's MAX_ARG_STRLEN)"),
    (HEAD + "env:\n" + "".join(f"  V{i}: {'x' * 60000}\n" for i in range(5)),
     f"7: env: {5 * 60003} bytes in all; at most 262144"),
    (HEAD + "train:\n  args: [" + ", ".join("a" for _ in range(1001)) + "]\n",
     "8: train.args: 1001 arguments; at most 1000"),
    (_workers(9999, "train:\n  args: ['--w={worker_hosts}']\n"),
     "15: train.args[0]: expands to 139989 bytes; one argument may be at most 131072 (execve's MAX_ARG_STRLEN)"),
], ids=["env-entries", "env-entry-bytes", "env-bytes", "args", "arg-expanded"])
def test_limits_are_one_line_errors_naming_the_field(tmp_path, text, expected):
    path = tmp_path / "l.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        load_spec(str(path))
    assert str(info.value) == f"{path}:" + expected


def test_a_plan_that_would_outgrow_the_limit_is_refused_naming_its_largest_part(tmp_path):
    path = tmp_path / "l.yaml"
    path.write_text(_workers(2000, "train:\n  args: ['{worker_hosts}', '{worker_hosts}']\n"))
    with pytest.raises(SpecError) as info:
        load_spec(str(path))
    assert str(info.value).startswith(f"{path}:15: train.args: 2001 tasks × ")
    assert "(TF_CONFIG, env and arguments; the largest part is the arguments) make a plan of" in str(info.value)
    assert str(info.value).endswith("MiB; at most 64 MiB")
    path.write_text(_workers(1500))                     # TF_CONFIG alone: fine at 1,500 tasks
    assert len(build_plan(load_spec(str(path))).tasks) == 1501
    with pytest.raises(UsageError, match=r"^train.args: 1501 tasks × \d+ bytes each .*at most 64 MiB$"):
        with_train_overrides(load_spec(str(path)), args=["{worker_hosts}"] * 3)


MEASURE = """\
import resource, subprocess, sys, time
t = time.monotonic()
r = subprocess.run([sys.executable, "-m", "tfcluster", "plan", "--json", sys.argv[1]],
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
print(r.returncode, round(time.monotonic() - t, 2),
      resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024, r.stderr.splitlines()[0][:60])
"""


@pytest.mark.parametrize("name,text", [
    # the review's blow-ups: 206 MB and 292 MB of RSS before, gigabytes at the task limit
    ("worker-hosts-arg", _workers(2000, "train:\n  args: ['{worker_hosts}']\n")),
    ("env-times-tasks", _workers(1000, "env:\n" + "".join(f"  V{i}: value{i}\n" for i in range(2000)))),
    ("tf-config-alone", _workers(9000)),                # 1.3 GB of TF_CONFIG before
])
def test_a_small_spec_that_would_expand_to_gigabytes_is_refused_fast_and_small(tmp_path, name, text):
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    assert path.stat().st_size < 64 << 10
    out = subprocess.run([sys.executable, "-c", MEASURE, str(path)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "NO_COLOR": "1"})
    code, seconds, rss_mb, line = out.stdout.split(" ", 3)
    assert code == "2" and line.startswith(f"tfcluster: error: {path}"[:60]), out.stdout + out.stderr
    assert int(rss_mb) < 100, f"{rss_mb} MB"
    assert float(seconds) < 20

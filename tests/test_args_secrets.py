"""A URL's password in train.args (`postgres://bob:pw@db/exp`, `--proxy=http://alice:pw@proxy`)
never reaches a command line on a host, where every user sees it in `ps`: the spec is refused
with one line naming the file, the argument's line and field, the URL masked, and the fix (read
it from the environment); `-- ARGS` on the command line likewise. A URL with a user and no
password is allowed, and shown masked wherever tfcluster shows it (plan --json, the manifest)
while the task still gets it whole. Real CLI runs, a real local `train`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import local_spec, tfcluster

pytestmark = pytest.mark.timeout(120)

PASSWORDS = ("s3cretpw", "hunter2")
HEAD = """\
name: sec
hosts:
  - {name: local, address: 127.0.0.1}
jobs:
  worker: {tasks: ["local:%d"]}
train:
  mode: mirrored
  script: train.py
  args:
    - --steps
    - "5"
"""                 # the args listed after HEAD start on line 12


def spec_with(tmp_path: Path, *args: str) -> Path:
    (tmp_path / "train.py").write_text("print('hi')\n")
    path = tmp_path / "sec.yaml"
    path.write_text(HEAD % 23999 + "".join(f"    - {json.dumps(a)}\n" for a in args))
    return path


@pytest.mark.parametrize("command", [["plan"], ["plan", "--commands"], ["plan", "--json"], ["train"],
                                     ["render", "--to", "slurm", "-o", "out"], ["down"]])
@pytest.mark.parametrize("args, line, index, shown", [
    (["--db", "postgres://bob:s3cretpw@db.lab/exp"], 13, 3, "postgres://***@db.lab/exp"),
    (["--proxy=http://alice:hunter2@proxy:3128", "--x"], 12, 2, "http://***@proxy:3128"),
], ids=["plain", "in-an-option"])
def test_a_url_password_in_train_args_is_refused_with_one_line_naming_file_line_and_field(
        tmp_path, home, command, args, line, index, shown):
    spec = spec_with(tmp_path, *args)
    r = tfcluster(*command, str(spec), home=home, cwd=tmp_path, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    first, *rest = r.stderr.splitlines()
    assert first == (f"tfcluster: error: {spec}:{line}: train.args[{index}]: holds the password of a "
                     f"URL ({shown}); script arguments are visible in `ps` on every host: read it "
                     f"from the environment"), r.stderr
    assert len(rest) == 1 and rest[0].startswith("hint: put the URL in env: under a secret name"), rest
    assert "Traceback" not in r.stderr
    assert not any(p in r.stdout + r.stderr for p in PASSWORDS)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()   # nothing started or written


def test_a_url_password_given_after_dashdash_is_refused_too(tmp_path, home):
    spec = spec_with(tmp_path)
    r = tfcluster("train", str(spec), "--", "--steps", "5", "--db=mysql://root:s3cretpw@10.0.0.9/x",
                  home=home, cwd=tmp_path, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.splitlines()[0] == (
        "tfcluster: error: script argument 3: holds the password of a URL (mysql://***@10.0.0.9/x); "
        "script arguments are visible in `ps` on every host: read it from the environment"), r.stderr
    assert "s3cretpw" not in r.stdout + r.stderr and not (tmp_path / "runs").exists()


def test_urls_without_a_password_run_and_a_user_is_masked_where_shown(tmp_path, home):
    (tmp_path / "echo.py").write_text("import json, sys\nprint('ARGV ' + json.dumps(sys.argv[1:]))\n")
    args = ["--repo", "ssh://git@git.lab/exp.git", "--page=http://localhost:8080/a@b", "--data", "s3://bucket/k"]
    spec = local_spec(tmp_path, mode="mirrored", script=str(tmp_path / "echo.py"), ps=0, workers=1, args=args)
    shown = ["--repo", "ssh://***@git.lab/exp.git", "--page=http://localhost:8080/a@b", "--data", "s3://bucket/k"]
    plan = tfcluster("plan", str(spec), "--json", home=home, cwd=tmp_path, timeout=60)
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["tasks"][0]["script"][2:] == shown
    listed = tfcluster("plan", str(spec), "--commands", home=home, cwd=tmp_path, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert "git@" not in listed.stdout and "ssh://***@git.lab/exp.git" in listed.stdout, listed.stdout
    run = tfcluster("train", str(spec), home=home, cwd=tmp_path, timeout=100)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"ARGV {json.dumps(args)}" in run.stdout             # the task gets every argument whole
    manifests = list((tmp_path / "runs").glob("*/manifest.json"))
    assert len(manifests) == 1
    manifest = json.loads(manifests[0].read_text())
    text = json.dumps(manifest)
    assert "git@" not in text and "ssh://***@git.lab/exp.git" in text, text[:500]


@pytest.mark.parametrize("logdir, problem", [
    ("gs://alice:pw9pw9pw9@bucket/tb", "holds the password of a URL (gs://***@bucket/tb); TensorBoard's --logdir is "
                                       "visible in `ps` on the chief's host, and in plans and manifests"),
    ("/data/tb-hunter2hunter2", "contains the value of secret env DB_PASSWORD; TensorBoard's --logdir is visible "
                                "in `ps` on the chief's host"),
])
def test_tensorboards_logdir_is_held_to_the_rule_script_arguments_are(tmp_path, home, logdir, problem):
    """train.tensorboard and --tensorboard go on TensorBoard's command line, where every user of
    the chief's host sees them in `ps`, and into plans and the manifest: refused as an argument
    would be, before anything is shown or started."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    spec = tmp_path / "tb.yaml"
    spec.write_text("name: tb\nhosts: [{name: local, address: 127.0.0.1}]\n"
                    "jobs: {worker: {tasks: ['local:23998']}}\nenv: {DB_PASSWORD: hunter2hunter2}\n"
                    f"train:\n  mode: mirrored\n  script: train.py\n  tensorboard: {json.dumps(logdir)}\n")
    for command in (["plan", "--json"], ["train"]):
        refused = tfcluster(*command, str(spec), home=home, cwd=tmp_path)
        assert refused.returncode == 2 and refused.stdout == "", refused.stdout
        assert refused.stderr.startswith(f"tfcluster: error: {spec}:8: train.tensorboard: {problem}\n"), refused.stderr
        assert "pw9pw9pw9" not in refused.stderr and "hunter2hunter2" not in refused.stderr
    spec.write_text(spec.read_text().replace(json.dumps(logdir), "/data/tb"))
    given = tfcluster("train", str(spec), "--dry-run", "--tensorboard", logdir, home=home, cwd=tmp_path)
    assert given.returncode == 2 and given.stderr.startswith(f"tfcluster: error: --tensorboard: {problem}\n")
    assert not (tmp_path / "runs").exists()

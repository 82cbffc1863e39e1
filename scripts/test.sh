#!/usr/bin/env bash
# Installs everything the test suite needs (OpenSSH server, Slurm + MUNGE, TensorFlow CPU,
# test tools) and runs it. Slurm is optional: if it cannot be installed, its tests skip.
# Python packages go into the active virtual environment; with none active, into .venv here
# (made if missing: a system Python may refuse `pip install`, PEP 668).
# Usage: bash scripts/test.sh [pytest args...]   e.g. -m "not tf and not ssh and not slurm"
# (with arguments, one plain pytest run of what they select; add -n 2 for workers)
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
[ -x /usr/sbin/sshd ] || need_apt+=(openssh-server)
command -v ssh >/dev/null || need_apt+=(openssh-client)
command -v pdsh >/dev/null || need_apt+=(pdsh)
# iproute2: the bed of separate hosts, each a network namespace (tests/netns.py)
{ command -v ip >/dev/null || [ -x /usr/sbin/ip ]; } || need_apt+=(iproute2)
# nftables: up and train close TensorFlow's ports with it (tests/test_fence.py)
{ command -v nft >/dev/null || [ -x /usr/sbin/nft ]; } || need_apt+=(nftables)
# iptables: the fence's way where a host has no nft command (tests/test_fence.py)
{ command -v iptables >/dev/null || [ -x /usr/sbin/iptables ]; } || need_apt+=(iptables)
# Debian's python3 makes a venv only with python3-venv (ensurepip) installed.
if [ -z "${VIRTUAL_ENV:-}" ] && [ ! -x .venv/bin/python ] && ! python3 -c 'import ensurepip' 2>/dev/null; then
  need_apt+=(python3-venv)
fi
# A one-node Slurm for tests/slurm.py (slurmctld, slurmd, client tools; MUNGE for auth).
need_slurm=()
{ [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && command -v sbatch >/dev/null; } \
  || need_slurm+=(slurm-wlm)
[ -x /usr/sbin/munged ] || need_slurm+=(munge)
if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
if [ ${#need_apt[@]} -gt 0 ] || [ ${#need_slurm[@]} -gt 0 ]; then
  # a failed update fails the run only when a required package is missing
  $SUDO apt-get update -qq || [ ${#need_apt[@]} -eq 0 ]
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "installing ${need_apt[*]} (apt-get)"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
if [ ${#need_slurm[@]} -gt 0 ]; then
  echo "installing ${need_slurm[*]} (apt-get)"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_slurm[@]}" >/dev/null \
    || echo "slurm not installed: apt-get install ${need_slurm[*]} failed; the Slurm tests skip" >&2
fi

if [ -n "${VIRTUAL_ENV:-}" ]; then
  PY="$VIRTUAL_ENV/bin/python"
else
  [ -x .venv/bin/python ] || python3 -m venv .venv
  PY=.venv/bin/python
  echo "no virtual environment active: using $(pwd)/.venv"
fi
# uv installs what pip would, in a quarter of the time here (TensorFlow's wheel is most of an
# install: 14 s against 53 s in a fresh venv); it comes into this venv with pip, and pip does
# the installs where uv cannot be had or fails. Bytecode is compiled as pip does: under
# PYTHONDONTWRITEBYTECODE=1 nothing would write it later, and every import of TensorFlow
# would compile it again.
if "$PY" -m pip install -q --disable-pip-version-check "uv>=0.13" >/dev/null 2>&1; then
  pip_into() {   # pip_into PYTHON ARGS...: install ARGS into PYTHON's environment
    local into=$1; shift
    "$PY" -m uv pip install -q --compile-bytecode --python "$into" "$@" \
      || { echo "uv pip install $* failed: trying pip" >&2; "$into" -m pip install -q --disable-pip-version-check "$@"; }
  }
else
  pip_into() { local into=$1; shift; "$into" -m pip install -q --disable-pip-version-check "$@"; }
fi
pip_into "$PY" -e '.[test]'
# tf_keras (Keras 2, which `train.keras: legacy` runs) for the installed TensorFlow's minor. It
# declares the full `tensorflow` wheel as its dependency, which beside tensorflow-cpu would put a
# second TensorFlow over the first: its dependencies are TensorFlow's own, so none are fetched.
tf_minor=$("$PY" - <<'PY' 2>/dev/null || true
import importlib.metadata as m
for name in ("tensorflow-cpu", "tensorflow"):
    try:
        print(".".join(m.version(name).split(".")[:2]))
        break
    except m.PackageNotFoundError:
        pass
PY
)
if [ -n "$tf_minor" ]; then
  pip_into "$PY" --no-deps "tf_keras~=$tf_minor.0"
fi
# Mode keras-jax's tests run a Python with jax, and `plot -o`'s one with matplotlib; the rest of
# the suite runs TensorFlow without either, as many of its users have it: TensorFlow imports jax
# whenever it can (its TFLite converter's optional path) and Keras imports matplotlib.pyplot
# whenever it can (on every `import tensorflow`), about 1 s and 0.6 s of CPU each time, hundreds
# of times a run. So those two extras go into a venv of their own (`extras-layer` beside this
# one's bin/) that sees this one's packages through a .pth: pip there installs only what this
# venv lacks (uv, which does not read the .pth, links its own copies from its cache).
venv_dir=$("$PY" -c 'import sys; print(sys.prefix)')
layer="$venv_dir/extras-layer"
[ -x "$layer/bin/python" ] || "$PY" -m venv "$layer"
layer_site=$("$layer/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$PY" - "$layer_site/zz_tfcluster_suite_base.pth" <<'PY'
import sys, sysconfig
with open(sys.argv[1], "w") as f:
    f.write(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
PY
pip_into "$layer/bin/python" -e '.[jax,plot]'
export TFCLUSTER_TEST_EXTRAS_PYTHON="$layer/bin/python"
# An editable install writes no .pyc; under PYTHONDONTWRITEBYTECODE=1 (some CI images set it)
# every CLI start the tests make would compile tfcluster from source. Python still reads them.
"$PY" -m compileall -q tfcluster >/dev/null
# Likewise pytest's assertion rewriting of the test modules: it reads its cache under that
# variable but writes none, so every pytest process (each xdist worker) rewrote them all
# again (1.6 s of CPU each here). One collection without it writes the cache once.
PYTHONDONTWRITEBYTECODE= "$PY" -m pytest -q --collect-only -p no:cacheprovider >/dev/null 2>&1 || true

set +e
if [ $# -gt 0 ]; then
  "$PY" -m pytest -q "$@"
  rc=$?
else
  # The whole suite, on pytest-xdist workers: one per two cores, at least 2 and at most 4 (set
  # TFCLUSTER_TEST_WORKERS to choose). A third of a serial run's time is spent waiting (a TF1
  # worker's 30 s poll for its chief, a deadline, a host's silence): a second worker fills it
  # even on 2 cores (measured there: 20% less time). A third there gained 9% one sitting and
  # 1% another, against more load on every test that judges a deadline: not worth it. A test
  # that judges a few seconds of wall-clock time cannot share the load: it is marked `alone`,
  # and those run after the parallel part, in two lanes of one test at a time: the notices'
  # (minutes spent waiting out their deadlines on the bed) and the rest (tests/conftest.py).
  # Not beside it in a cgroup of their own, weighted as much as the parallel part's: that took
  # 2-6% off two runs (1261 and 1319 s against 1344 s) and failed the third. Inside a cgroup
  # the kernel's autogroup (a share per session, and every task is a session of its own) is
  # off, so a TensorFlow process's thread pools outweigh the one-thread processes the
  # deadlines time: the launcher, a shim, a fake metadata service (a move's resume 39 s after
  # the notice, not 9; a metadata GET timed out).
  # The Slurm tests share one worker (one Slurm cluster).
  half=$(( $(nproc 2>/dev/null || echo 1) / 2 ))
  workers=${TFCLUSTER_TEST_WORKERS:-$(( half < 2 ? 2 : half ))}
  [ "$workers" -gt 4 ] && workers=4
  if [ "$workers" -gt 1 ]; then
    # The quick tests (no TensorFlow, sshd or Slurm: 1,000 of them, 4 % of the suite's CPU) run
    # beside the workers, in one process of a session of its own whose autogroup weighs a third
    # of a default one (nice 5): they take the CPU the long tests leave idle while they wait
    # (about a fifth of it), and little of what those use. Their output follows the workers'.
    quick="not alone and not tf and not ssh and not slurm"
    quick_log=$(mktemp "${TMPDIR:-/tmp}/tfcluster-quick-tests.XXXXXX")
    # shellcheck disable=SC2016
    setsid bash -c 'echo 5 > /proc/self/autogroup 2>/dev/null; exec "$@"' quick-tests \
      "$PY" -m pytest -q -p no:cacheprovider -m "$quick" > "$quick_log" 2>&1 < /dev/null &
    quick_pid=$!
    quick_done() { wait "$quick_pid"; rc_quick=$?; echo "the quick tests, run beside them:"; cat "$quick_log"; rm -f "$quick_log"; }
    # a Ctrl-C reaches the workers (this terminal's group), and the quick lane through this
    trap 'kill -INT -- -"$quick_pid" 2>/dev/null; quick_done; exit 130' INT TERM
    # --durations: where a run's time went, at its end (the place to look when CI slows)
    "$PY" -m pytest -q -n "$workers" --dist loadgroup -m "not alone and (tf or ssh or slurm)" --durations=30
    rc=$?
    quick_done
    trap - INT TERM
    [ $rc -eq 0 ] && rc=$rc_quick
    "$PY" -m pytest -q -n 2 --dist loadgroup -m alone --durations=10
    rc_alone=$?
    [ $rc -eq 0 ] && rc=$rc_alone
  else
    "$PY" -m pytest -q
    rc=$?
  fi
fi
set -e
if [ $rc -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit $rc

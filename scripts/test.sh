#!/usr/bin/env bash
# Installs everything the test suite needs (OpenSSH server, TensorFlow CPU, test tools)
# and runs it. Usage: bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
[ -x /usr/sbin/sshd ] || need_apt+=(openssh-server)
command -v ssh >/dev/null || need_apt+=(openssh-client)
command -v pdsh >/dev/null || need_apt+=(pdsh)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  echo "installing ${need_apt[*]} (apt-get)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

python3 -m pip install -q --disable-pip-version-check -e '.[test]'

set +e
python3 -m pytest -q "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit $rc

#!/usr/bin/env bash
# tools/setup.sh, the one set-up of the two commands and CI. Usage: setup_test.sh CASE
#   idempotent     on this (set-up) machine a run installs nothing, prints nothing, exits 0
#   no_permission  a package missing and no root: exit 1 and the exact command to run
#   offline        a package missing, root, no network: exit 1 and the exact command to run
# The last two run a copy of tools/ whose package list adds one name Debian does not have.
set -euo pipefail

case_name=$1
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
work=$(mktemp -d /tmp/ucp_setup.XXXXXX)
trap 'rm -rf "$work"' EXIT
fail() {
  echo "FAIL ($case_name): $*" >&2
  exit 1
}

missing=ucp-test-no-such-package
copy_with_missing_package() {
  mkdir "$work/tools"
  cp "$root/tools/setup.sh" "$root/tools/requirements.txt" "$root/tools/debian-packages.txt" \
    "$work/tools/"
  echo "$missing" >>"$work/tools/debian-packages.txt"
  chmod -R a+rX "$work"
}
# expect_refusal OUTPUT COMMAND_PREFIX: the run said what is missing and how to install it.
expect_refusal() {
  grep -q "^setup: .*$missing" "$1" || fail "the missing package is not named: $(cat "$1")"
  grep -qF "    $2'apt-get update && apt-get install -y --no-install-recommends $missing'" "$1" ||
    fail "no install command: $(cat "$1")"
}

case "$case_name" in
  idempotent)
    start=$(date +%s%N)
    "$root/tools/setup.sh" >"$work/out" 2>&1 || fail "exit $?: $(cat "$work/out")"
    elapsed_ms=$((($(date +%s%N) - start) / 1000000))
    [[ ! -s $work/out ]] || fail "a run on a set-up machine printed: $(cat "$work/out")"
    echo "set-up present: nothing installed, ${elapsed_ms} ms"
    ;;
  no_permission)
    command -v setpriv >/dev/null || { echo "skip: no setpriv"; exit 77; }
    ((EUID == 0)) || { echo "skip: must start as root to drop to nobody"; exit 77; }
    copy_with_missing_package
    status=0
    setpriv --reuid=nobody --regid=nogroup --clear-groups env PATH=/usr/bin:/bin \
      bash "$work/tools/setup.sh" --no-venv >"$work/out" 2>&1 || status=$?
    ((status == 1)) || fail "exit $status, not 1: $(cat "$work/out")"
    expect_refusal "$work/out" "sudo sh -c "
    cat "$work/out"
    ;;
  offline)
    ((EUID == 0)) || { echo "skip: needs root for unshare -n"; exit 77; }
    unshare -n true 2>/dev/null || { echo "skip: unshare -n is not permitted here"; exit 77; }
    copy_with_missing_package
    status=0
    unshare -n bash "$work/tools/setup.sh" --no-venv >"$work/out" 2>&1 || status=$?
    ((status == 1)) || fail "exit $status, not 1: $(cat "$work/out")"
    expect_refusal "$work/out" "sh -c "
    grep "^setup: " "$work/out"
    ;;
  *)
    fail "unknown case"
    ;;
esac
echo "ok: $case_name"

#!/usr/bin/env bash
# The save side end to end under the real preload: two python3 processes (RANK=0 and RANK=1)
# write a real DeepSpeed tag (tests/shared fixtures) the way DeepSpeed does, rank 1 later than
# rank 0's `latest`; rank 0's libucp.so must index the tag once rank 1's file is closed.
# Usage: saveindex_test.sh CASE, with UCP_LIB (libucp.so), UCP_CLI (the ucp tool), UCP_PYTHON,
# FIXTURES (../shared/fixtures/deepspeed) and PRELOAD_FIRST set.
#   wait CONFIG  rank 0 keeps running after its save: index.json appears once rank 1 closed its
#                file (not before) and is byte for byte what `ucp index` writes for the tag
#   exit         rank 0 exits right after its save: its teardown still indexes the tag
#   kill         rank 1 never finishes; rank 0 is killed (SIGKILL) while its builder waits: no
#                index.json, and nothing in .ucp/ a reader could take for one
set -euo pipefail

case_name=$1
config=${2:-z2_fp32}
here=$(dirname "$0")
work=$(mktemp -d /tmp/ucp_saveindex.XXXXXX)
pids=()
cleanup() {
  local pid_file
  for pid_file in "$work"/rank*.pid; do
    [[ -f "$pid_file" ]] && kill -9 "$(cat "$pid_file")" 2>/dev/null || true
  done
  rm -rf "$work"
}
trap cleanup EXIT

fail() {
  echo "FAIL ($case_name): $*" >&2
  cat "$work"/logs/ucp.*.log >&2 2>/dev/null || true
  exit 1
}

fixture=$FIXTURES/$config/dp2/global_step5
save=$work/save
tag=$save/global_step5
mkdir -p "$work/logs" "$save"

# rank R ARGS...: write_rank.py for rank R under the preload, stdout to $work/rankR.out.
rank() {
  local r=$1
  shift
  env RANK="$r" WORLD_SIZE=2 UCP_LOG_DIR="$work/logs" UCP_LOG_LEVEL=info \
    LD_PRELOAD="${PRELOAD_FIRST:+$PRELOAD_FIRST }$UCP_LIB" \
    timeout 120 "$UCP_PYTHON" "$here/write_rank.py" "$save" "$fixture" "$r" "$@" \
    >"$work/rank$r.out"
}

# The index `ucp index` writes for a copy of the tag's files, hashing every file itself.
same_as_cli() {
  [[ -f "$tag/.ucp/index.json" ]] || fail "no index.json"
  mkdir -p "$work/copy/global_step5"
  cp "$tag"/*.pt "$work/copy/global_step5/"
  "$UCP_CLI" index --no-journal "$work/copy/global_step5" >/dev/null ||
    fail "ucp index of the copy failed"
  cmp -s "$tag/.ucp/index.json" "$work/copy/global_step5/.ucp/index.json" ||
    fail "index.json differs from ucp index's"
}

case "$case_name" in
  wait)
    rank 0 --then wait-index &
    pids+=($!)
    rank 1 --delay 1.5 || fail "rank 1 failed"
    wait "${pids[0]}" || fail "rank 0 failed"
    grep -qx "index before last close: no" "$work/rank1.out" ||
      fail "an index existed before rank 1 closed its file: $(cat "$work/rank1.out")"
    same_as_cli
    ;;

  exit)
    rank 0 &
    pids+=($!)
    rank 1 --delay 1.5 || fail "rank 1 failed"
    wait "${pids[0]}" || fail "rank 0 failed"
    same_as_cli
    ;;

  kill)
    rank 0 --then wait-index --pid-file "$work/rank0.pid" &
    pids+=($!)
    rank 1 --delay 0.5 --then hang --pid-file "$work/rank1.pid" &
    pids+=($!)
    for _ in $(seq 100); do
      [[ -f "$save/latest" ]] && grep -q hanging "$work/rank1.out" 2>/dev/null && break
      sleep 0.1
    done
    grep -q hanging "$work/rank1.out" || fail "rank 1 did not start its file"
    [[ -f "$save/latest" ]] || fail "rank 0 did not commit"
    sleep 1  # several of the builder's polls
    grep -q '"role":"commit"' "$tag"/.ucp/journal.*.jsonl || fail "rank 0 journaled no commit"
    pythons=("$(cat "$work/rank0.pid")" "$(cat "$work/rank1.pid")")
    kill -9 "${pythons[@]}"
    wait "${pids[@]}" 2>/dev/null || true
    [[ ! -e "$tag/.ucp/index.json" ]] || fail "index.json of an incomplete save"
    leftovers=$(find "$tag/.ucp" -mindepth 1 ! -name 'journal.*.jsonl' ! -name index.lock)
    [[ -z "$leftovers" ]] || fail "left in .ucp/: $leftovers"
    ;;

  *)
    fail "unknown case"
    ;;
esac
echo "ok: $case_name $config"

#!/usr/bin/env bash
# Instructions libucp.so adds per call on a file it does not track, with its hooks installed as
# in a trainer (the save tracker and the serve policy), counted by valgrind's callgrind: the same
# on a busy machine as on an idle one, unlike times. call_loop makes N calls of one kind; the
# count at N = 11000 minus the count at N = 1000, over 10000, is the cost of one call (start-up
# cancels out). Runs from run.sh when valgrind is installed. Expects BUILD_DIR.
set -euo pipefail
loop=$BUILD_DIR/tests/bench/interpose/call_loop
lib=$BUILD_DIR/libucp.so
work=$(mktemp -d /tmp/ucp_bench_calls.XXXXXX)
trap 'rm -rf "$work"' EXIT
echo data >"$work/file"

# instructions PRELOAD N CALL: what callgrind collected over the whole run.
instructions() {
  LD_PRELOAD=$1 valgrind --tool=callgrind --callgrind-out-file=/dev/null \
    "$loop" "$work/file" "$2" "$3" 2>&1 | sed -n 's/.*Collected : \([0-9]*\).*/\1/p'
}
per_call() { echo $((($(instructions "$1" 11000 "$2") - $(instructions "$1" 1000 "$2")) / 10000)); }

printf '%-12s %14s %14s %14s\n' "call" "plain instr" "ucp instr" "added instr"
for call in write stat open_read open_write; do
  plain=$(per_call "" "$call")
  ucp=$(per_call "$lib" "$call")
  printf '%-12s %14d %14d %14d\n' "$call" "$plain" "$ucp" $((ucp - plain))
done

#!/usr/bin/env bash
# The load side under the real preload: a copy of a DeepSpeed fixture tag saved at dp4, indexed
# with `ucp index`, read by python3 + torch with LD_PRELOAD=libucp.so at other world sizes.
# Usage: serve_test.sh CASE, with UCP_LIB (libucp.so), UCP_CLI (ucp), UCP_PYTHON, PRELOAD_FIRST
# and FIXTURES (the DeepSpeed fixtures directory) set.
#   served       WORLD_SIZE=2: the tag reads as `ucp reshard --to dp=2` wrote it (bytes, torch.load,
#                exists/stat of the ranks that are and are not there)
#   listing      os.listdir, os.scandir and glob show the dp2 file set (dp8: the added ranks)
#   passthrough  WORLD_SIZE=4 (the source's): the real files, no view is created
#   corrupt      a source byte changed after indexing: the first process, whose open of the
#                model states builds the view and meets the damage in another of its files,
#                reads the real files (warning naming the bytes), and so do later processes,
#                which find the job's verdict recorded; under UCP_STRICT=1, OSError EIO
#   concurrent   8 processes open every file at once: each file is built once, same bytes
#   parts        the same with UCP_BUILD_PART_KB=32: every file is built in parts (the model
#                states, one 0.26 MB storage, in 7), each part once by whichever process took
#                it (how many processes built the model states' parts is printed); the same bytes
#   stale_owner  the builds of two view files owned, as the preload finds them, by a process of
#                this host that is stopped (hung) and by one that is gone (dead): the reader takes
#                both over (the hung one after UCP_LEASE_STALE_MS) and reads ucp reshard's bytes
#   two_jobs     a job at dp2 and a job at dp8 read the tag at once: each its own view, right
set -euo pipefail

case_name=$1
here=$(dirname "$0")
work=$(mktemp -d /tmp/ucp_serve.XXXXXX)
trap 'rm -rf "$work"' EXIT

fail() {
  echo "FAIL ($case_name): $*" >&2
  exit 1
}

tag=$work/ckpt/global_step5
mkdir -p "$tag" "$work/logs"
cp "$FIXTURES"/z2_fp32/dp4/global_step5/*.pt "$tag/"
chmod u+w "$tag"/*.pt
"$UCP_CLI" index "$tag" >/dev/null || fail "ucp index"

# reference DP: `ucp reshard` of the tag at DP, in $work/ref<DP>/global_step5.
reference() {
  "$UCP_CLI" reshard "$tag" --to "dp=$1" --out "$work/ref$1" >/dev/null || fail "ucp reshard dp=$1"
}

# served_python [ENV=VALUE...] -- ARGS...: check_serve.py under the preload.
served_python() {
  local vars=()
  while [[ $1 != -- ]]; do
    vars+=("$1")
    shift
  done
  shift
  env "${vars[@]}" UCP_LOG_DIR="$work/logs" UCP_LOG_LEVEL=info \
    LD_PRELOAD="${PRELOAD_FIRST:+$PRELOAD_FIRST }$UCP_LIB" "$UCP_PYTHON" "$here/check_serve.py" "$@"
}

built_lines() { cat "$work"/logs/ucp.*.log 2>/dev/null | grep -c "view: built" || true; }

# eight_readers [ENV=VALUE...]: 8 processes of a dp8 job, started at once, each read every file
# of the tag: all read `ucp reshard`'s bytes.
eight_readers() {
  reference 8
  local rank pid pids=()
  for rank in 0 1 2 3 4 5 6 7; do
    served_python WORLD_SIZE=8 RANK=$rank "$@" -- concurrent "$tag" "$work/go" \
      >"$work/digests.$rank" &
    pids+=($!)
  done
  sleep 2
  touch "$work/go"
  for pid in "${pids[@]}"; do wait "$pid" || fail "a reader failed"; done
  "$UCP_PYTHON" "$here/check_serve.py" digests "$work/ref8/global_step5" >"$work/digests.ref"
  for rank in 0 1 2 3 4 5 6 7; do
    cmp -s "$work/digests.$rank" "$work/digests.ref" ||
      fail "rank $rank read other bytes: $(diff "$work/digests.$rank" "$work/digests.ref")"
  done
}

case "$case_name" in
  served)
    reference 2
    served_python WORLD_SIZE=2 RANK=0 -- served "$tag" "$work/ref2/global_step5" 2 ||
      fail "check_serve.py served"
    [[ $(built_lines) == 3 ]] || fail "$(built_lines) files built, expected 3"
    ;;

  listing)
    reference 2
    reference 8
    served_python WORLD_SIZE=2 RANK=1 -- listing "$tag" "$work/ref2/global_step5" ||
      fail "check_serve.py listing at dp2"
    served_python WORLD_SIZE=8 RANK=5 -- listing "$tag" "$work/ref8/global_step5" ||
      fail "check_serve.py listing at dp8"
    ;;

  passthrough)
    served_python WORLD_SIZE=4 RANK=0 -- passthrough "$tag" ||
      fail "check_serve.py passthrough"
    [[ ! -e $tag/.ucp/views ]] || fail "a view was created for the source's own topology"
    ;;

  corrupt)
    # A byte of tensor data that dp2 rank 0's optimizer file takes (dp4 rank 1's partition).
    "$UCP_PYTHON" - "$tag/zero_pp_rank_1_mp_rank_00_optim_states.pt" <<'PY'
import os, sys
with open(sys.argv[1], "r+b") as f:
    middle = os.path.getsize(sys.argv[1]) // 2
    f.seek(middle)
    byte = f.read(1)
    f.seek(middle)
    f.write(bytes([byte[0] ^ 1]))
PY
    served_python WORLD_SIZE=2 RANK=0 -- corrupt "$tag" first || fail "check_serve.py corrupt first"
    grep -q "warning.*serve: $tag: .*zero_pp_rank_1_mp_rank_00_optim_states.pt: bytes .*fails its CRC-32.*pass through" \
      "$work"/logs/ucp.*.log || fail "no warning naming the changed bytes: $(cat "$work"/logs/ucp.*.log)"
    grep -q "^failed: .*fails its CRC-32" "$tag/.ucp/views/tp1-pp1-dp2/verdict" ||
      fail "the failed build is not the view's verdict"
    ls "$tag"/.ucp/views/tp1-pp1-dp2/ | grep -q "^served\.zero_pp_rank_0" &&
      fail "the file whose build met the damage is in the view"
    # Later processes of the job see the recorded failure before serving anything.
    served_python WORLD_SIZE=2 RANK=1 -- corrupt "$tag" lenient || fail "check_serve.py corrupt lenient"
    served_python WORLD_SIZE=2 RANK=0 UCP_STRICT=1 -- corrupt "$tag" strict ||
      fail "check_serve.py corrupt strict"
    ;;

  concurrent)
    eight_readers
    expected=$(ls "$work/ref8/global_step5" | wc -l)
    [[ $(built_lines) == "$expected" ]] || fail "$(built_lines) builds for $expected files"
    ;;

  parts)
    eight_readers UCP_BUILD_PART_KB=32
    cat "$work"/logs/ucp.*.log >"$work/all.log"
    model_parts=$(grep -c "view: built part [0-9]* of .*served.mp_rank_00_model_states.pt " \
      "$work/all.log" || true)
    ((model_parts == 7)) || fail "the model states were built in $model_parts parts, expected 7"
    duplicates=$(grep -o "view: built part [0-9]* of [^ ]*" "$work/all.log" | sort | uniq -d)
    [[ -z $duplicates ]] || fail "parts built twice: $duplicates"
    builders=$(grep -l "view: built part [0-9]* of .*served.mp_rank_00_model_states.pt " \
      "$work"/logs/ucp.*.log | wc -l)
    echo "the model states built in $model_parts parts by $builders processes"
    expected=$(ls "$work/ref8/global_step5" | wc -l)
    completed=$(grep -c "view: built .* from [0-9]* parts" "$work/all.log" || true)
    ((completed == expected)) || fail "$completed files completed from parts, expected $expected"
    ls -A "$tag/.ucp/views/tp1-pp1-dp8" | grep -q "\.parts$" && fail "a parts file was left"
    true
    ;;

  stale_owner)
    reference 2
    view=$tag/.ucp/views/tp1-pp1-dp2
    mkdir -p "$view"
    sleep 600 &
    hung=$!
    kill -STOP "$hung"
    trap 'kill -KILL "$hung" 2>/dev/null; rm -rf "$work"' EXIT
    echo "$(hostname) $hung hung-owner" >"$view/.mp_rank_00_model_states.pt.lease"
    bash -c 'exit 0' &
    dead=$!
    wait "$dead"
    echo "$(hostname) $dead dead-owner" >"$view/.zero_pp_rank_0_mp_rank_00_optim_states.pt.lease"
    start=$(date +%s%N)
    served_python WORLD_SIZE=2 RANK=0 UCP_LEASE_STALE_MS=700 -- served "$tag" \
      "$work/ref2/global_step5" 2 || fail "check_serve.py served past stale owners"
    waited_ms=$((($(date +%s%N) - start) / 1000000))
    ((waited_ms >= 700)) || fail "read in $waited_ms ms: the hung owner's build was not waited for"
    ((waited_ms < 60000)) || fail "read in $waited_ms ms"
    [[ $(built_lines) == 3 ]] || fail "$(built_lines) files built, expected 3"
    for lease in "$view"/.*.lease; do
      [[ ! -e $lease ]] || fail "lease $lease left behind"
    done
    echo "taken over from a hung and a dead owner; read in $waited_ms ms"
    ;;

  two_jobs)
    reference 2
    reference 8
    served_python WORLD_SIZE=2 RANK=0 -- served "$tag" "$work/ref2/global_step5" 2 &
    first=$!
    served_python WORLD_SIZE=8 RANK=3 -- served "$tag" "$work/ref8/global_step5" 8 &
    second=$!
    wait "$first" || fail "the dp2 job failed"
    wait "$second" || fail "the dp8 job failed"
    [[ -f $tag/.ucp/views/tp1-pp1-dp2/view.json && -f $tag/.ucp/views/tp1-pp1-dp8/view.json ]] ||
      fail "not two views"
    ;;

  *)
    fail "unknown case"
    ;;
esac
echo "ok: $case_name"

#!/usr/bin/env bash
# Fault injection in ucp's own I/O under the real preload (libucp_faults.so, UCP_TEST_FAULTS):
# for each fault, the host (fault_host.py: a DeepSpeed-shaped save, or a load) observes exactly
# what it observes without ucp, and ucp's own state is either complete or absent.
# Usage: faults_test.sh CASE, with UCP_FAULTS_LIB, UCP_CLI, UCP_PYTHON, FIXTURES, PRELOAD_FIRST.
#   index    faults in the index build (reading the sources, writing index.json): EINTR and
#            short transfers give the index `ucp index` writes; ENOSPC/EIO give no index.json
#   journal  faults in journal appends: EINTR and short writes give whole lines and the index;
#            a failed append leaves no torn line (also after a short write) and no index
#   view     faults in the view build at WORLD_SIZE=2 of a dp4 tag: EINTR and short transfers
#            serve `ucp reshard`'s bytes; ENOSPC/EIO serve nothing (the original files pass
#            through, no served file is left), and under UCP_STRICT=1 the opens fail with EIO;
#            flock unsupported (ENOLCK on every flock: Lustre noflock) serves them through the
#            lease that stands in for it
#   view_parts  the same with every file built in parts (UCP_BUILD_PART_KB=32): a failed part
#            or completion serves nothing and leaves no parts' file
#   atoms    faults in the atoms store (UCP_MODE=atoms, two ranks): EINTR and short transfers
#            give the store of a run without faults; ENOSPC/EIO leave the index without a store
#   durable  faults in the durable commit (UCP_DURABLE=1): EINTR is retried and `latest` is
#            published; a failed fsync or rename publishes nothing
# Every case also checks that the fault fired and that no temporary file is left.
set -euo pipefail

case_name=$1
here=$(dirname "$0")
work=$(mktemp -d /tmp/ucp_faults.XXXXXX)
trap 'rm -rf "$work"' EXIT
dp2=$FIXTURES/z2_fp32/dp2/global_step5
dp4=$FIXTURES/z2_fp32/dp4/global_step5
spec=""

fail() {
  echo "FAIL ($case_name, UCP_TEST_FAULTS=$spec): $*" >&2
  cat "$work"/logs/ucp.*.log >&2 2>/dev/null || true
  echo "faults injected:" >&2
  cat "$work/fired" >&2 2>/dev/null || true
  exit 1
}

host() { "$UCP_PYTHON" "$here/fault_host.py" "$@"; }

# faulty [ENV=VALUE...] -- ARGS...: fault_host.py under libucp_faults.so with $spec armed.
faulty() {
  local vars=()
  while [[ $1 != -- ]]; do
    vars+=("$1")
    shift
  done
  shift
  env "${vars[@]}" UCP_TEST_FAULTS="$spec" UCP_TEST_FAULTS_LOG="$work/fired" \
    UCP_LOG_DIR="$work/logs" UCP_LOG_LEVEL=info \
    LD_PRELOAD="${PRELOAD_FIRST:+$PRELOAD_FIRST }$UCP_FAULTS_LIB" \
    timeout 120 "$UCP_PYTHON" "$here/fault_host.py" "$@"
}

# A fresh run directory for the next fault.
fresh() {
  rm -rf "$work/run" "$work/logs" "$work/fired"
  mkdir -p "$work/run" "$work/logs"
  : >"$work/fired"
}

# The fault must have fired (a test whose fault never happens proves nothing).
fired() {
  [[ -s $work/fired ]] || fail "the fault never fired"
}

# No temporary of ucp's anywhere under DIR (WriteFileAtomically's and the writers' names).
no_temporaries() {
  local left
  left=$(find "$1" -name '*.ucp-tmp-*' -o -name '*.tmp.*')
  [[ -z $left ]] || fail "temporary files left: $left"
}

# The tag's files are the fixture's, byte for byte.
same_files() {
  local name
  for name in $(cd "$2" && ls *.pt); do
    cmp -s "$1/$name" "$2/$name" || fail "$1/$name differs from the fixture's"
  done
}

# Save-side checks of $work/run/global_step5: the host saw what it sees without ucp, the files are
# the fixture's, no temporary, and the index is REF's (`index`) or absent (`none`).
check_save() {
  local expected=$1 observed=$2 plain=$3 tag=$work/run/global_step5
  diff -u "$plain" "$observed" >&2 || fail "the host observed something else than without ucp"
  same_files "$tag" "$dp2"
  no_temporaries "$work/run"
  case $expected in
    index) cmp -s "$tag/.ucp/index.json" "$work/ref_index.json" ||
      fail "index.json missing or not the one ucp index writes" ;;
    none | waits) [[ ! -e $tag/.ucp/index.json ]] || fail "an index.json despite the fault" ;;
  esac
}

# save_run OUTCOME: the whole tag saved by one host under the faults, output in $work/out. An
# OUTCOME of `waits` (the builder waits for a journal record that never lands, or for reads
# that keep failing) has the host leave without ucp's teardown, which would wait 2 minutes.
save_run() {
  if [[ $1 == waits ]]; then
    faulty -- save "$work/run" "$dp2" all --wait-index 1 --hard-exit >"$work/out" ||
      fail "host exit status $?"
  else
    faulty -- save "$work/run" "$dp2" all >"$work/out" || fail "host exit status $?"
  fi
}

# The plain save (no preload) and the index `ucp index` writes for it.
plain_save() {
  mkdir -p "$work/plain"
  host save "$work/plain" "$dp2" all >"$work/plain.out" || fail "plain save"
  "$UCP_CLI" index --no-journal "$work/plain/global_step5" >/dev/null || fail "ucp index"
  cp "$work/plain/global_step5/.ucp/index.json" "$work/ref_index.json"
}

# Every journal line of the run is whole JSON; prints their number.
journal_lines() {
  "$UCP_PYTHON" - "$work"/run/global_step5/.ucp/journal.*.jsonl <<'PY'
import json, sys
lines = 0
for path in sys.argv[1:]:
    data = open(path, "rb").read()
    if data and not data.endswith(b"\n"):
        sys.exit(f"{path}: torn last line")
    for line in data.splitlines():
        json.loads(line)
        lines += 1
print(lines)
PY
}

case "$case_name" in
  index)
    plain_save
    # PHASE:OP:KIND[:FIRST[:COUNT]] -> the index expected. Reads: the first few are the model
    # states' while the builder waits for the save (a failure there is retried at the next poll;
    # failing every time, the builder keeps waiting: `waits`, the host leaves without teardown),
    # the 33rd is in the index build proper (each archive's opening read of its first bytes, the
    # check for torch's legacy format, counts as one; before it, the deepspeed-tp and
    # deepspeed-zero12 adapters' detections and the builder's wait each open the model states). Writes: the temporary index.json; syncs:
    # its fsync, then the directory's after the rename.
    for entry in \
      index:read:EINTR:1:0=index index:read:short:1:0=index index:read:EIO=index \
      index:read:EIO:1:0=waits index:read:EIO:33=none \
      index:open:EINTR:1:0=index index:open:ENOSPC=none \
      index:write:EINTR:1:0=index index:write:short:1:0=index index:write:ENOSPC=none \
      index:write:EIO=none \
      index:sync:EINTR:1:0=index index:sync:EIO=none index:sync:EIO:2=index \
      index:rename:EINTR:1:0=index index:rename:EIO=none; do
      spec=${entry%=*}
      fresh
      save_run "${entry##*=}"
      fired
      check_save "${entry##*=}" "$work/out" "$work/plain.out"
    done
    ;;

  durable)
    plain_save
    # UCP_DURABLE=1: EINTR on the fsyncs of the files, the directories and the pending `latest`,
    # and on its rename, is retried: `latest` is published and the index built. A failed fsync
    # or rename publishes nothing: `latest` keeps its previous state (here: absent).
    for entry in durable:sync:EINTR:1:0=published durable:rename:EINTR:1:0=published \
      durable:sync:EIO=unpublished durable:rename:EIO=unpublished; do
      spec=${entry%=*}
      fresh
      if [[ ${entry##*=} == published ]]; then
        faulty UCP_DURABLE=1 -- save "$work/run" "$dp2" all >"$work/out" ||
          fail "host exit status $?"
      else
        faulty UCP_DURABLE=1 -- save "$work/run" "$dp2" all --wait-index 1 --hard-exit \
          >"$work/out" ||
          fail "host exit status $?"
      fi
      fired
      diff -u "$work/plain.out" "$work/out" >&2 || fail "the host observed something else"
      same_files "$work/run/global_step5" "$dp2"
      no_temporaries "$work/run"
      if [[ ${entry##*=} == published ]]; then
        [[ $(cat "$work/run/latest") == global_step5 ]] || fail "latest not published"
        cmp -s "$work/run/global_step5/.ucp/index.json" "$work/ref_index.json" ||
          fail "index.json missing or not the one ucp index writes"
      else
        [[ ! -e $work/run/latest ]] || fail "latest published despite the fault"
      fi
    done
    ;;

  journal)
    plain_save
    # -> the index expected and the number of whole journal lines (3 files and the commit).
    # A lost data record keeps the builder waiting for it; a lost commit record (the 4th) is
    # not needed by the builder of the process that committed. The save generation's write (the
    # phase's only rename) is needed only by a later save of the tag: its failure is logged.
    for entry in \
      journal:rename:EIO=index:4 \
      journal:write:EINTR:1:0=index:4 journal:write:short:1:0=index:4 \
      journal:open:EINTR:1:0=index:4 journal:write:EIO:4=index:3 \
      journal:write:ENOSPC=waits:3 journal:open:EIO=waits:3 \
      journal:write:short:1:1,journal:write:ENOSPC:2:1=waits:3; do
      spec=${entry%=*}
      outcome=${entry##*=}
      fresh
      save_run "${outcome%:*}"
      fired
      check_save "${outcome%:*}" "$work/out" "$work/plain.out"
      lines=$(journal_lines) || fail "a journal line is not whole"
      [[ $lines == "${outcome##*:}" ]] || fail "$lines journal lines, expected ${outcome##*:}"
    done
    ;;

  view | view_parts)
    part_kb=()
    [[ $case_name == view_parts ]] && part_kb=(UCP_BUILD_PART_KB=32)
    names=(mp_rank_00_model_states.pt zero_pp_rank_0_mp_rank_00_optim_states.pt
      zero_pp_rank_1_mp_rank_00_optim_states.pt)
    mkdir -p "$work/tag"
    cp "$dp4"/*.pt "$work/tag/"
    chmod u+w "$work/tag"/*.pt
    "$UCP_CLI" index "$work/tag" >/dev/null || fail "ucp index"
    "$UCP_CLI" reshard "$work/tag" --to dp=2 --out "$work/ref" >/dev/null || fail "ucp reshard"
    host load "$work/tag" "${names[@]}" >"$work/plain.out"
    host load "$work/ref/tag" "${names[@]}" >"$work/served.out"
    cmp -s "$work/plain.out" "$work/served.out" && fail "dp2 and dp4 files alike: no test"
    printf '%s errno=EIO\n' "${names[@]}" >"$work/eio.out"
    # -> what the host reads: `served` (ucp reshard's bytes), `plain` (the files as saved),
    # `eio` (UCP_STRICT=1). Opens, writes, syncs and renames: view.json's first (its temporary,
    # fsync, rename, the directory's fsync), then the first file's. Reads: index.json's, then
    # the sources' verification.
    for entry in \
      view:read:EINTR:1:0=served view:read:short:1:0=served view:write:EINTR:1:0=served \
      view:write:short:1:0=served view:open:EINTR:1:0=served view:sync:EINTR:1:0=served \
      view:rename:EINTR:1:0=served view:lock:ENOLCK:1:0=served view:lock:EIO=plain \
      view:read:EIO:2=plain view:write:ENOSPC=plain view:open:ENOSPC:2=plain \
      view:write:ENOSPC:2=plain view:write:EIO:2=plain view:sync:EIO=plain \
      view:rename:EIO:2=plain view:write:ENOSPC:2=eio; do
      spec=${entry%=*}
      expected=${entry##*=}
      fresh
      rm -rf "$work/run/tag"
      cp -r "$work/tag" "$work/run/tag"
      strict=0
      [[ $expected == eio ]] && strict=1
      faulty WORLD_SIZE=2 RANK=0 UCP_STRICT=$strict "${part_kb[@]}" -- load "$work/run/tag" \
        "${names[@]}" >"$work/out" || fail "host exit status $?"
      fired
      diff -u "$work/$expected.out" "$work/out" >&2 || fail "the host read other bytes"
      no_temporaries "$work/run"
      views=$work/run/tag/.ucp/views
      left=$(find "$views" -name '*.parts' 2>/dev/null || true)
      [[ -z $left ]] || fail "a parts' file left: $left"
      if [[ $case_name == view_parts && $expected == served ]]; then
        grep -q "view: built .*served.mp_rank_00_model_states.pt from [0-9]* parts" \
          "$work"/logs/ucp.*.log || fail "the model states were not built in parts"
      fi
      # The view's files, not their placeholders (.planned/, made with the view).
      built=$(find "$views" -path '*/.planned' -prune -o -name 'served.*' -print 2>/dev/null || true)
      if [[ $expected == served ]]; then
        [[ $(wc -l <<<"$built") == 3 ]] || fail "not 3 files in the view"
      else
        [[ -z $built ]] || fail "a file in the view"
      fi
      if [[ $spec == view:read:EIO:2 ]]; then
        [[ ! -e $views/tp1-pp1-dp2/view.json ]] || fail "a read error recorded in view.json"
      fi
    done
    ;;

  atoms)
    # ranks RUNDIR [faulty|plain]: ranks 0 and 1 save their files of the dp2 fixture at once.
    ranks() {
      local r pids=()
      for r in 0 1; do
        if [[ $2 == faulty ]]; then
          faulty UCP_MODE=atoms RANK=$r WORLD_SIZE=2 -- save "$1" "$dp2" $r >"$work/out$r" &
        else
          spec="" faulty UCP_MODE=atoms RANK=$r WORLD_SIZE=2 -- save "$1" "$dp2" $r \
            >"$work/plain$r.out" &
        fi
        pids+=($!)
      done
      wait "${pids[0]}" || fail "rank 0 exit status"
      wait "${pids[1]}" || fail "rank 1 exit status"
    }
    # The store's files and index.json, by content.
    store_digest() {
      (cd "$1/global_step5/.ucp" && find atoms index.json -type f | sort | xargs sha256sum)
    }
    plain_save
    fresh
    ranks "$work/run" plain
    grep -q '"store"' "$work/run/global_step5/.ucp/index.json" || fail "no store without faults"
    store_digest "$work/run" >"$work/store.ref"
    for entry in \
      atoms:read:EINTR:1:0=store atoms:read:short:1:0=store atoms:write:EINTR:1:0=store \
      atoms:write:short:1:0=store atoms:open:EINTR:1:0=store atoms:sync:EINTR:1:0=store \
      atoms:rename:EINTR:1:0=store \
      atoms:read:EIO=none atoms:open:ENOSPC=none atoms:write:ENOSPC=none atoms:write:EIO:3=none \
      atoms:sync:EIO=none atoms:rename:EIO=none; do
      spec=${entry%=*}
      fresh
      ranks "$work/run" faulty
      fired
      for r in 0 1; do
        diff -u "$work/plain$r.out" "$work/out$r" >&2 || fail "rank $r observed something else"
      done
      same_files "$work/run/global_step5" "$dp2"
      no_temporaries "$work/run"
      if [[ ${entry##*=} == store ]]; then
        store_digest "$work/run" | diff -u "$work/store.ref" - >&2 || fail "another store"
      else
        cmp -s "$work/run/global_step5/.ucp/index.json" "$work/ref_index.json" ||
          fail "index.json is not the index without a store"
      fi
    done
    ;;

  *)
    fail "unknown case"
    ;;
esac
echo "ok: $case_name"

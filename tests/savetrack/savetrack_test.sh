#!/usr/bin/env bash
# Save tracking under the real preload: python3 + torch write DeepSpeed-named checkpoints with
# LD_PRELOAD=libucp.so, and the journal, the commit log line and the saved files are checked.
# Usage: savetrack_test.sh CASE, with UCP_LIB (libucp.so), UCP_PYTHON and PRELOAD_FIRST set.
#   journal  one record per torch.save'd file (size, xxh3 = xxhsum -H3), commit logged, files
#            load to the same objects as without the preload, byte for byte the same
#   detect   a plain open().write() of a DeepSpeed name is tracked by name, not under
#            UCP_DETECT=stack; torch.save'd files are tracked in both
#   roots    with UCP_ROOTS, only saves below a root are tracked
set -euo pipefail

case_name=$1
here=$(dirname "$0")
work=$(mktemp -d /tmp/ucp_savetrack.XXXXXX)
trap 'rm -rf "$work"' EXIT

fail() {
  echo "FAIL ($case_name): $*" >&2
  exit 1
}

# save SAVE_DIR [ENV=VALUE...] [-- SCRIPT ARGS...]: save_checkpoint.py under the preload.
save() {
  local dir=$1
  shift
  env "$@" LD_PRELOAD="${PRELOAD_FIRST:+$PRELOAD_FIRST }$UCP_LIB" \
    "$UCP_PYTHON" "$here/save_checkpoint.py" "$dir" ${PLAIN:+--plain "$PLAIN"} ||
    fail "save_checkpoint.py under the preload failed"
}

check() { "$UCP_PYTHON" "$here/check.py" "$@" || fail "check.py $*"; }

torch_files=(mp_rank_00_model_states.pt zero_pp_rank_0_mp_rank_00_optim_states.pt
  zero_pp_rank_1_mp_rank_00_optim_states.pt bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt
  layer_00-model_states.pt)

case "$case_name" in
  journal)
    mkdir "$work/logs"
    "$UCP_PYTHON" "$here/save_checkpoint.py" "$work/plain" || fail "save without the preload"
    save "$work/ucp" RANK=3 UCP_LOG_DIR="$work/logs" UCP_LOG_LEVEL=info
    check journal "$work/ucp/global_step5" 3 "${torch_files[@]}"
    grep -q "deepspeed commit of tag global_step5 in $work/ucp ($work/ucp/latest)" \
      "$work"/logs/ucp.*.log || fail "no commit in the log: $(cat "$work"/logs/ucp.*.log)"
    check same "$work/plain/global_step5" "$work/ucp/global_step5" "${torch_files[@]}"
    for name in "${torch_files[@]}"; do
      cmp -s "$work/plain/global_step5/$name" "$work/ucp/global_step5/$name" ||
        fail "$name differs from the file saved without the preload"
    done
    # The comparison can fail: two different files do not compare equal.
    if "$UCP_PYTHON" "$here/check.py" same "$work/plain/global_step5/mp_rank_00_model_states.pt" \
      "$work/plain/global_step5/layer_00-model_states.pt" . >/dev/null 2>&1; then
      fail "check.py same accepts different files"
    fi
    ;;

  detect)
    look_alike=mp_rank_01_model_states.pt
    PLAIN=$look_alike save "$work/name" RANK=0
    check journal "$work/name/global_step5" 0 "${torch_files[@]}" "$look_alike"
    PLAIN=$look_alike save "$work/stack" RANK=0 UCP_DETECT=stack
    check journal "$work/stack/global_step5" 0 "${torch_files[@]}"
    ;;

  roots)
    mkdir "$work/inside" "$work/outside"
    save "$work/outside/run" RANK=1 UCP_ROOTS="$work/inside:/nonexistent"
    check untracked "$work/outside/run/global_step5"
    save "$work/inside/run" RANK=1 UCP_ROOTS="$work/inside:/nonexistent"
    check journal "$work/inside/run/global_step5" 1 "${torch_files[@]}"
    ;;

  *)
    fail "unknown case"
    ;;
esac
echo "ok: $case_name"

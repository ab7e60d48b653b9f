#!/usr/bin/env bash
# Real-DeepSpeed check of `ucp reshard` (not part of CI: needs DeepSpeed v0.14.5 at DS_SRC).
# For each fixture config (default: z2_fp32 z2_fp32_odd z2_bf16): `ucp reshard <cfg>/dp4/global_step5
# --to dp=2`, then unmodified DeepSpeed resumes training from ucp's output with a PLAIN
# engine.load_checkpoint at DP=2 (../../../../shared/tools/deepspeed-cpu/train.py via launch.py) and
# runs steps 6..10. Its losses are compared with the fixture's logs: A_dp4_full (the uninterrupted
# DP=4 run; must agree within 1e-6 in fp32, 1e-3 in bf16, see losses_summary.txt) and, for
# information, D_uc_dp4_to_dp2 (DeepSpeed's own universal resume at DP=2): equal in fp32; in bf16
# a plain resume differs from a universal one by ~7e-4 even from DeepSpeed's own resaved files
# (ORACLE=1 shows it). A plain load of the dp4 tag itself at DP=2 fails in DeepSpeed ("Automatic
# adjustment of ZeRO's optimizer state partitioning with a new world size is not currently supported").
# Usage: DS_SRC=/tmp/ds UCP=build/ucp ds_resume_check.sh [cfg ...]   (cfg: a ZeRO-1/2 fixture folder name)
#        ORACLE=1 uses DeepSpeed's own resaved/dp2_from_dp4 instead of ucp (checks this script).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../../.." && pwd)
fixtures=$repo/../shared/fixtures/deepspeed
tools=$repo/../shared/tools/deepspeed-cpu
: "${DS_SRC:?set DS_SRC to a DeepSpeed v0.14.5 source folder}"
# shellcheck source=/dev/null
. "$tools/env.sh"
ucp=${UCP:-$repo/build/ucp}
configs=("$@")
((${#configs[@]})) || configs=(z2_fp32 z2_fp32_odd z2_bf16)
work=$(mktemp -d /tmp/ucp_ds_resume.XXXXXX)
trap 'rm -rf "$work"' EXIT

failed=0
port=29710
for cfg in "${configs[@]}"; do
  out=$work/$cfg
  if [[ -n ${ORACLE:-} ]]; then
    src="DeepSpeed's resaved/dp2_from_dp4"
    cp -r "$fixtures/$cfg/resaved/dp2_from_dp4" "$out"
  else
    src="ucp reshard --to dp=2"
    "$ucp" reshard "$fixtures/$cfg/dp4/global_step5" --to dp=2 --out "$out"
  fi
  # The fixture's own training arguments (model size, stage, dtype, ...) from its DP=4 run log.
  mapfile -t train_args < <("$PY" - "$fixtures/$cfg/losses/A_dp4_full.json" <<'EOF'
import json, sys
a = json.load(open(sys.argv[1]))['args']
for key in ('stage', 'dtype', 'vocab', 'd', 'nlayer', 'nhead', 'seq', 'lr', 'seed'):
    if key in a:
        print(f'--{key}'); print(a[key])
if a.get('grad_accum_fp32'):
    print('--grad_accum_fp32')
EOF
  )
  log=$work/$cfg.log
  if ! (cd "$tools" && "$PY" launch.py 2 $((port++)) train.py "${train_args[@]}" --steps 10 \
      --load_dir "$out" --out "$work/$cfg.json") >"$log" 2>&1; then
    echo "ds_resume_check: $cfg: DeepSpeed failed to resume from $src:"
    grep -E 'Error|Exception' "$log" | tail -3
    failed=1
    continue
  fi
  "$PY" - "$cfg" "$src" "$work/$cfg.json" "$fixtures/$cfg/losses" <<'EOF' || failed=1
import json, sys
cfg, src, got, logs = sys.argv[1:]
losses = {int(k): v for k, v in json.load(open(got))['losses'].items()}
def ref(name):
    return {int(k): v for k, v in json.load(open(f'{logs}/{name}.json'))['losses'].items()}
uc, full = ref('D_uc_dp4_to_dp2'), ref('A_dp4_full')
steps = list(range(6, 11))
assert sorted(losses) == steps, f'steps {sorted(losses)}'
d_uc = max(abs(losses[s] - uc[s]) for s in steps)
d_full = max(abs(losses[s] - full[s]) for s in steps)
tol = 1e-3 if 'bf16' in cfg else 1e-6
print(f'ds_resume_check: {cfg}: plain DP=2 resume from {src}: losses 6..10 '
      + ' '.join(f'{losses[s]:.8f}' for s in steps)
      + f'; max|d| vs DeepSpeed universal resume at DP=2 {d_uc:.3e}, vs uninterrupted DP=4 {d_full:.3e} (tol {tol:g})')
sys.exit(0 if d_full <= tol else 1)
EOF
done
exit $failed

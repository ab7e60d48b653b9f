#!/usr/bin/env bash
# The demo: a 4-rank CPU training run saves a ZeRO-2 checkpoint, which then resumes at 2 and at
# 8 ranks under LD_PRELOAD=libucp.so, next to an uninterrupted 4-rank run and to the same resume
# without ucp (the framework refuses it). Prints a loss table, draws demo/out/loss.png.
#
# Usage: demo/run.sh [--deepspeed | --stand-in]
#   default: real DeepSpeed when `python3 -c "import deepspeed"` works, else the stand-in
#   (demo/zero_trainer.py, plain PyTorch writing DeepSpeed's ZeRO-2 checkpoint layout).
# Environment: UCP_PYTHON (default /usr/bin/python3, needs torch), DEMO_PORT (first TCP port,
# default 29700), UCP_BUILD_JOBS (ninja -j when libucp.so must be built).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")
py=${UCP_PYTHON:-/usr/bin/python3}
out=$here/out
steps=10
save_step=5
port=${DEMO_PORT:-29700}

mode=auto
case "${1:-}" in
  --deepspeed) mode=deepspeed ;;
  --stand-in) mode=stand-in ;;
  "") ;;
  *) echo "usage: demo/run.sh [--deepspeed | --stand-in]" >&2; exit 2 ;;
esac
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu} OMP_NUM_THREADS=1 MASTER_ADDR=127.0.0.1
if [[ $mode == auto ]]; then
  if "$py" -c "import deepspeed" >/dev/null 2>&1; then mode=deepspeed; else mode=stand-in; fi
fi
if [[ $mode == deepspeed ]]; then
  if ! "$py" -c "import deepspeed" >/dev/null 2>&1; then
    echo "demo: --deepspeed, but '$py -c \"import deepspeed\"' fails" >&2
    exit 2
  fi
  trainer=$here/ds_trainer.py
  version=$("$py" -c "import deepspeed; print(deepspeed.__version__)" 2>/dev/null | tail -1)
  echo "trainer: real DeepSpeed $version (demo/ds_trainer.py)"
else
  trainer=$here/zero_trainer.py
  echo "trainer: the stand-in, demo/zero_trainer.py (plain PyTorch in DeepSpeed v0.14.5's ZeRO-2" \
    "checkpoint layout; DeepSpeed is not importable here or --stand-in was given)"
fi

# libucp.so, built once (Release) into build/.
if [[ ! -f $root/build/build.ninja ]]; then
  cmake -S "$root" -B "$root/build" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
fi
ninja -C "$root/build" ${UCP_BUILD_JOBS:+-j "$UCP_BUILD_JOBS"} ucp >/dev/null
preload=(env LD_PRELOAD="$root/build/libucp.so" UCP_LOG_DIR="$out/ucp-logs")

rm -rf "$out"
mkdir -p "$out/ucp-logs"
ckpt=$out/checkpoints

# run NAME NPROC [env...] -- trainer args: one launch, output in out/NAME.log; returns its status.
run() {
  local name=$1 nproc=$2
  shift 2
  local prefix=()
  while [[ $1 != -- ]]; do prefix+=("$1"); shift; done
  shift
  port=$((port + 1))
  "${prefix[@]}" "$py" "$here/launch.py" "$nproc" "$port" "$trainer" "$@" >"$out/$name.log" 2>&1
}

status=0
echo "1/5 4 ranks, steps 1..$steps, uninterrupted"
run full_dp4 4 env -- --steps $steps --out "$out/full_dp4.json"
echo "2/5 4 ranks under ucp, steps 1..$save_step, saves $ckpt/global_step$save_step"
run save_dp4 4 "${preload[@]}" -- --steps $save_step --save_dir "$ckpt" --save_at $save_step \
  --out "$out/save_dp4.json"
for n in 2 8; do
  echo "$((n == 2 ? 3 : 4))/5 resume at $n ranks under ucp, steps $((save_step + 1))..$steps"
  if ! run resume_dp$n $n "${preload[@]}" -- --steps $steps --load_dir "$ckpt" \
    --out "$out/resume_dp$n.json"; then
    echo "    FAILED: see $out/resume_dp$n.log"
    status=1
  fi
done
echo "5/5 resume at 2 ranks without ucp (the framework should refuse)"
if run plain_dp2 2 env -- --steps $steps --load_dir "$ckpt" --out "$out/plain_dp2.json"; then
  echo "    the resume without ucp did not fail" >&2
  status=1
else
  grep -m1 -o "[A-Za-z_.]*ZeRORuntimeException: .*" "$out/plain_dp2.log" >"$out/refusal.txt" || true
fi
echo
"$py" "$here/report.py" "$out" $save_step
exit $status

#!/usr/bin/env bash
# The demo: a 4-rank CPU training run saves a ZeRO-2 checkpoint, which then resumes at 2 and at
# 8 ranks under LD_PRELOAD=libucp.so, next to an uninterrupted 4-rank run and to the same resume
# without ucp (the framework refuses it). Prints a loss table, draws demo/out/loss.png.
#
# Usage: demo/run.sh [--deepspeed | --stand-in]
#   default: real DeepSpeed, the release pinned in tools/requirements.txt, from the project's
#   virtual environment; the stand-in (demo/zero_trainer.py, plain PyTorch writing DeepSpeed's
#   ZeRO-2 checkpoint layout, run by Debian's /usr/bin/python3) only when DeepSpeed cannot be
#   installed here or --stand-in is given.
# It first runs tools/setup.sh (installs what is missing, says what) and builds libucp.so with
# tools/build.sh (shows the failing compiler lines and stops when the build fails).
# Environment: UCP_PYTHON (the interpreter for the trainer; default .venv/bin/python, or
# /usr/bin/python3 for the stand-in), DEMO_PORT (first TCP port, default 29700), BUILD_DIR,
# UCP_BUILD_JOBS (tools/build.sh).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")
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

# The Debian packages are needed in every mode (the build, the stand-in's torch); the virtual
# environment only for DeepSpeed, and its failure is what sends the default mode to the stand-in.
"$root/tools/setup.sh" --no-venv
if [[ $mode != stand-in && -z ${UCP_PYTHON:-} ]]; then
  if "$root/tools/setup.sh"; then
    mode=deepspeed
  elif [[ $mode == deepspeed ]]; then
    echo "demo: --deepspeed, but DeepSpeed could not be installed (tools/setup.sh says why above)" >&2
    exit 2
  else
    echo "demo: DeepSpeed could not be installed (tools/setup.sh says why above): falling back" \
      "to the stand-in" >&2
    mode=stand-in
  fi
fi
if [[ $mode == stand-in ]]; then
  py=${UCP_PYTHON:-/usr/bin/python3}
else
  py=${UCP_PYTHON:-$root/.venv/bin/python}
  if ! "$py" -c "import deepspeed" >/dev/null 2>&1; then
    if [[ $mode == deepspeed ]]; then
      echo "demo: '$py -c \"import deepspeed\"' fails" >&2
      exit 2
    fi
    mode=stand-in
  fi
fi
if [[ $mode == stand-in ]]; then
  trainer=$here/zero_trainer.py
  echo "trainer: the stand-in, demo/zero_trainer.py (plain PyTorch in DeepSpeed v0.14.5's ZeRO-2" \
    "checkpoint layout; DeepSpeed could not be installed here, or --stand-in was given)"
else
  trainer=$here/ds_trainer.py
  versions=$("$py" -c "import deepspeed, torch; print(deepspeed.__version__, torch.__version__)" \
    2>/dev/null | tail -1)
  echo "trainer: real DeepSpeed ${versions% *} on torch ${versions#* }, CPU with gloo" \
    "(demo/ds_trainer.py)"
fi

# libucp.so (the ninja target of the preload library is its file: `ucp` names the CLI).
build_dir=${BUILD_DIR:-$root/build}
BUILD_DIR=$build_dir "$root/tools/build.sh" libucp.so
preload=(env LD_PRELOAD="$build_dir/libucp.so" UCP_LOG_DIR="$out/ucp-logs")

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

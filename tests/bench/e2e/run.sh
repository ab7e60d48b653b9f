#!/usr/bin/env bash
# Overhead of LD_PRELOAD=libucp.so on a real training job (issue 5): the same trainer, seeds and
# arguments without and with the preload, alternating, REPS runs each; prints the mean ± spread of
# the step time and the save time (wall and CPU) and of the whole job, and whether each difference
# is within noise (bench_e2e.py). The trainer: real DeepSpeed (ZeRO-2 fp32,
# ../../../../shared/tools/deepspeed-cpu/train.py in place) when `import deepspeed` works (DS_SRC,
# as its env.sh uses it), else the plain-PyTorch stand-in demo/zero_trainer.py; TRAINER=deepspeed or
# TRAINER=standin forces one. BUILD_DIR (set by tests/bench/run.sh) holds libucp.so; run alone, this
# builds libucp.so in Release into build-bench (the Ninja target `ucp` is the CLI's file, whose
# output name is also ucp, so the library is asked for by its file name).
# Env: REPS (runs each, default 3), NPROC (ranks, default 2), STEPS (default 24), SAVE_EVERY
# (default 4), UCP_BENCH_DIR (scratch, default /tmp/ucp-bench-e2e; results.md is written there),
# BENCH_ARGS (more bench_e2e.py flags, e.g. --d 384 --nlayer 6, or --mode atoms for UCP_MODE=atoms).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../../.." && pwd)
python=${UCP_PYTHON:-/usr/bin/python3}
tools=$repo/../shared/tools/deepspeed-cpu
if [[ -z ${BUILD_DIR:-} ]]; then
  BUILD_DIR=$repo/build-bench
  cmake -S "$repo" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DUCP_BUILD_BENCH=ON -DUCP_BUILD_TESTS=OFF >/dev/null
  cmake --build "$BUILD_DIR" -j 2 --target libucp.so
fi

deepspeed_importable() {
  [[ -n ${DS_SRC:-} && -f $tools/env.sh ]] || return 1
  # shellcheck source=/dev/null
  (. "$tools/env.sh" && "$python" -c 'import deepspeed' >/dev/null 2>&1)
}
trainer=${TRAINER:-}
if [[ -z $trainer ]]; then
  if deepspeed_importable; then
    trainer=deepspeed
  elif [[ -f $repo/demo/zero_trainer.py ]]; then
    trainer=standin
  else
    echo "bench e2e: skipped: DeepSpeed is not importable (DS_SRC) and demo/zero_trainer.py is missing"
    exit 0
  fi
fi
if [[ $trainer == deepspeed ]]; then
  : "${DS_SRC:?TRAINER=deepspeed needs DS_SRC (DeepSpeed v0.14.5 source folder)}"
  export DS_SRC
fi
# shellcheck disable=SC2086 # BENCH_ARGS is a list of flags
"$python" "$here/bench_e2e.py" --trainer "$trainer" --lib "$BUILD_DIR/libucp.so" --tools "$tools" \
  --work "${UCP_BENCH_DIR:-/tmp/ucp-bench-e2e}" --python "$python" --reps "${REPS:-3}" \
  --nproc "${NPROC:-2}" --steps "${STEPS:-24}" --save_every "${SAVE_EVERY:-4}" ${BENCH_ARGS:-}

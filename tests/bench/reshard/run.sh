#!/usr/bin/env bash
# Reshard/export benchmark (issue 4): on a generated DeepSpeed ZeRO-2 DP=4 tag of >= 2 GiB, times
# `cp -r`, `ucp index`, `ucp reshard --to dp=2|dp=8`, `ucp export --format safetensors|deepspeed-universal`
# and, when DeepSpeed is importable (DS_SRC), DeepSpeed's ds_to_universal.py, in one run; prints a
# markdown table (also written to $UCP_BENCH_DIR/results.md). First checks that the generator still
# writes the fixtures' exact pickles (check_gen.py). BUILD_DIR (set by tests/bench/run.sh) holds the
# `ucp` binary; run alone, this builds target ucp_cli in Release into build-bench.
# Env: UCP_BENCH_DIR (scratch, default /tmp/ucp-bench-reshard; the tag is generated once and kept),
# UCP_BENCH_OUT (where the commands write, default the scratch folder; e.g. /dev/shm), REPS (default 3),
# DS_REPS (default 1), DS_SRC, BENCH_ARGS (more bench_reshard.py flags, e.g. --cold).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../../.." && pwd)
python=${UCP_PYTHON:-/usr/bin/python3}
if [[ -z ${BUILD_DIR:-} ]]; then
  BUILD_DIR=$repo/build-bench
  cmake -S "$repo" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DUCP_BUILD_BENCH=ON -DUCP_BUILD_TESTS=OFF >/dev/null
  cmake --build "$BUILD_DIR" -j 2 --target ucp_cli
fi
"$python" "$here/check_gen.py"
# shellcheck disable=SC2086 # BENCH_ARGS is a list of flags
"$python" "$here/bench_reshard.py" --ucp "$BUILD_DIR/ucp" --reps "${REPS:-3}" --ds-reps "${DS_REPS:-1}" ${BENCH_ARGS:-}

#!/usr/bin/env bash
# Serve benchmark (issue 21): N processes under the preload in DeepSpeed's load pattern over a
# generated ZeRO-2 tag of 2.6 GB saved at DP=4, against `ucp reshard` of the same tag, in one run
# (bench_serve.py). BUILD_DIR (set by tests/bench/run.sh) holds `ucp` and libucp.so; run alone,
# this builds both in Release into build-bench.
# Env: UCP_BENCH_DIR (scratch, default /tmp/ucp-bench-serve; the tag is generated once and kept),
# PROCS (default 8,16), REPS (default 2), PRESET (default gpt2; tiny for a quick look), METADATA=1
# (each rank under strace: its metadata operations on the view instead of timings), PART_KB
# (comma-separated UCP_BUILD_PART_KB values, "default" for unset: a row each), MODEL_ONLY=1 (each
# rank reads the model states alone, under UCP_CACHE_DIR), UCP_BENCH_PYTHON (the generator's and
# the loaders' interpreter, default /usr/bin/python3).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../../.." && pwd)
if [[ -z ${BUILD_DIR:-} ]]; then
  BUILD_DIR=$repo/build-bench
  cmake -S "$repo" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DUCP_BUILD_BENCH=ON \
    -DUCP_BUILD_TESTS=OFF >/dev/null
  # The library by its file name: in this tree `ucp` is also the CLI's file.
  cmake --build "$BUILD_DIR" -j 2 --target ucp_cli libucp.so
fi
/usr/bin/python3 "$here/bench_serve.py" --ucp "$BUILD_DIR/ucp" --lib "$BUILD_DIR/libucp.so" \
  --procs "${PROCS:-8,16}" --reps "${REPS:-2}" --preset "${PRESET:-gpt2}" \
  --part-kb "${PART_KB:-default}" ${MODEL_ONLY:+--model-states-only} \
  ${METADATA:+--metadata}

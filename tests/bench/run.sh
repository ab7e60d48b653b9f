#!/usr/bin/env bash
# The benchmark command: builds with -DUCP_BUILD_BENCH=ON into build-bench (Release) and runs
# every tests/bench/<topic>/run.sh with BUILD_DIR set. Results print as tables; nothing asserts.
# Usage: tests/bench/run.sh [topic ...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export BUILD_DIR=${BUILD_DIR:-$PWD/build-bench}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DUCP_BUILD_BENCH=ON -DUCP_BUILD_TESTS=OFF >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)"
topics=("$@")
if ((${#topics[@]} == 0)); then
  for script in tests/bench/*/run.sh; do topics+=("$(basename "$(dirname "$script")")"); done
fi
for topic in "${topics[@]}"; do
  echo "== bench: $topic"
  bash "tests/bench/$topic/run.sh"
done

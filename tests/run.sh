#!/usr/bin/env bash
# The test command (README "Run the tests"): configure, build, and run every test with CTest.
# BUILD_DIR selects the build folder (default: build).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build_dir=${BUILD_DIR:-build}
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DUCP_WERROR=ON
cmake --build "$build_dir" -j "$(nproc)"
ctest --test-dir "$build_dir" --output-on-failure -j "$(nproc)"

# The libFuzzer targets need clang: a second build, each target fuzzing for UCP_FUZZ_SECONDS.
if [[ -n "$(ls tests/fuzz/*_fuzz.cc 2>/dev/null)" && "${UCP_SKIP_FUZZ:-0}" != 1 ]]; then
  fuzz_dir=${FUZZ_BUILD_DIR:-build-fuzz}
  CC=clang CXX=clang++ cmake -S . -B "$fuzz_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DUCP_BUILD_TESTS=OFF -DUCP_BUILD_FUZZ=ON -DUCP_FUZZ_SECONDS="${UCP_FUZZ_SECONDS:-60}"
  cmake --build "$fuzz_dir" -j "$(nproc)"
  ctest --test-dir "$fuzz_dir" --output-on-failure -L fuzz
fi

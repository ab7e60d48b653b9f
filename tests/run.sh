#!/usr/bin/env bash
# The test command (README "Run the tests"): configure, build, and run every test with CTest.
# BUILD_DIR selects the build folder (default: build).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build_dir=${BUILD_DIR:-build}
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DUCP_WERROR=ON
cmake --build "$build_dir" -j "$(nproc)"
ctest --test-dir "$build_dir" --output-on-failure -j "$(nproc)"

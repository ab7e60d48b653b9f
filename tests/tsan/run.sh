#!/usr/bin/env bash
# ThreadSanitizer run (issue 6): configures BUILD_DIR (default build-tsan) with g++ and
# -DUCP_TSAN=ON, builds only what the thread-heavy tests need (libucp.so, the CLI, the preload,
# NCCL and e2e hosts, the fault-injecting preload, and the unit tests of the fd table, the save
# tracker and the index builder),
# then runs those unit tests and the CTest labels `preload` (preload, nccl, savetrack, saveindex,
# serve) and `e2e` (python3 + torch under the preload), libtsan preloaded before libucp.so.
# halt_on_error=1: any report fails its test.
# g++ because its libtsan.so can be preloaded into python3 (clang links its runtime statically
# into executables, so an instrumented libucp.so could not be preloaded into an uninstrumented one).
# Usage: tests/tsan/run.sh [CTEST_ARGS...]   e.g. tests/tsan/run.sh -R preload_tracked_hammer
# JOBS (default nproc) limits the build's and CTest's parallelism.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
build_dir=${BUILD_DIR:-build-tsan}
jobs=${JOBS:-$(nproc)}
CC=gcc CXX=g++ cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DUCP_TSAN=ON -DUCP_WERROR=ON >/dev/null
unit_tests=(interpose_fd_table_test hooks_save_save_tracker_test hooks_save_index_builder_test)
# libucp.so by file name: in the build folder, `ucp` is also the CLI's file.
cmake --build "$build_dir" -j "$jobs" --target libucp.so ucp_cli tests/preload/all \
  tests/nccl/all tests/faults/all "${unit_tests[@]}"

export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$PWD/tests/tsan/suppressions.txt ${TSAN_OPTIONS:-}"
for test in "${unit_tests[@]}"; do
  echo "== $test"
  "$build_dir/tests/$test" --gtest_brief=1
done
ctest --test-dir "$build_dir" --output-on-failure -j "$jobs" -L 'preload|e2e' "$@"

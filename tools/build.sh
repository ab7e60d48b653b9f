#!/usr/bin/env bash
# Builds the project as the two commands need it: configures BUILD_DIR (default build/) with the
# flags named here (RelWithDebInfo at -O2 -g1, warnings as errors, then any -D... arguments
# given), so that nothing cached by an earlier or failed configure decides them, then builds the
# ninja targets given (all when none). Prints what it builds and, when that fails, CMake's errors
# or the failing compiler commands with their diagnostics, and exits 1.
# Usage: tools/build.sh [-DVAR=VALUE ...] [NINJA_TARGET ...]
# Environment: BUILD_DIR, UCP_BUILD_JOBS (ninja -j), CC and CXX (the compilers, at the first
# configure of a folder).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir=${BUILD_DIR:-$root/build}
log=$(mktemp "${TMPDIR:-/tmp}/ucp-build.XXXXXX")
trap 'rm -f "$log"' EXIT
start=$SECONDS

# -g1: line tables and function names (what backtraces, perf and gdb's `bt` use) without the
# local-variable information of -g, which made 3/4 of libucp.so's 115 MB and a fifth of the
# build's time. A later -DCMAKE_CXX_FLAGS_RELWITHDEBINFO=... overrides it.
cmake_args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DUCP_WERROR=ON
  "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG"
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG")
while [[ ${1:-} == -D* ]]; do
  cmake_args+=("$1")
  shift
done
if ! cmake -S "$root" -B "$build_dir" -G Ninja "${cmake_args[@]}" >"$log" 2>&1; then
  echo "build: configuring $build_dir failed:" >&2
  grep -A12 -E '^CMake Error' "$log" >&2 || tail -40 "$log" >&2
  exit 1
fi

echo "build: ${*:-everything} in $build_dir (from scratch: minutes on 2 cores)" >&2
if ! ninja -C "$build_dir" -j "${UCP_BUILD_JOBS:-$(nproc)}" "$@" >"$log" 2>&1; then
  echo "build: building ${*:-everything} in $build_dir failed:" >&2
  # ninja prints "FAILED: <output>", the command, then the compiler's own lines, until its next
  # progress line "[n/N] ..." or its closing "ninja: build stopped".
  awk '/^FAILED: /{show=1} /^\[[0-9]+\/[0-9]+\] |^ninja: build stopped/{show=0} show' "$log" |
    head -200 >&2
  grep -q '^FAILED: ' "$log" || tail -40 "$log" >&2
  exit 1
fi
echo "build: done ($((SECONDS - start)) s)" >&2

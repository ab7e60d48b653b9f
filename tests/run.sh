#!/usr/bin/env bash
# The test command (README "Run the tests"): tools/setup.sh installs what is missing, tools/build.sh
# configures and builds (showing the failing compiler lines when the build fails), then CTest runs
# every test. Arguments go to ctest: `tests/run.sh -L e2e_deepspeed` runs that part alone. With no
# arguments the libFuzzer targets follow (UCP_SKIP_FUZZ=1 leaves them out).
# BUILD_DIR selects the build folder (default: build), FUZZ_BUILD_DIR the fuzz one (build-fuzz).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tools/setup.sh
# What the Python tests run on (package metadata only: importing torch takes seconds).
versions='import importlib.util as u, importlib.metadata as m
print(", ".join(f"{p} {m.version(p)}" for p in ("deepspeed", "torch") if u.find_spec(p)))'
for python in "${UCP_VENV:-.venv}/bin/python" .venv-deepspeed-0.14.5/bin/python /usr/bin/python3; do
  echo "tests: $python: $("$python" -c "$versions")"
done
build_dir=${BUILD_DIR:-build}
BUILD_DIR=$build_dir tools/build.sh
ctest --test-dir "$build_dir" --output-on-failure -j "$(nproc)" "$@"

# The libFuzzer targets need clang: a second build, each target fuzzing for UCP_FUZZ_SECONDS.
if (($# == 0)) && [[ -n "$(ls tests/fuzz/*_fuzz.cc 2>/dev/null)" && "${UCP_SKIP_FUZZ:-0}" != 1 ]]
then
  fuzz_dir=${FUZZ_BUILD_DIR:-build-fuzz}
  # Only the targets (and ucp_core, which they link): the preload and the CLI are not fuzzed.
  mapfile -t fuzz_targets < <(basename -s .cc tests/fuzz/*_fuzz.cc)
  CC=clang CXX=clang++ BUILD_DIR=$fuzz_dir tools/build.sh -DUCP_WERROR=OFF -DUCP_BUILD_TESTS=OFF \
    -DUCP_BUILD_FUZZ=ON -DUCP_FUZZ_SECONDS="${UCP_FUZZ_SECONDS:-30}" "${fuzz_targets[@]}"
  # One target per core: each fuzzes single-threaded for its own UCP_FUZZ_SECONDS.
  ctest --test-dir "$fuzz_dir" --output-on-failure -L fuzz -j "$(nproc)"
fi

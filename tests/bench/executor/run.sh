#!/usr/bin/env bash
# Executor benchmarks: ExecutePlan resharding and exporting a synthetic 1 GiB ZeRO-style layout
# (4 rank files, 64 atoms of 16 MiB laid end to end across them), against copying the same
# files with copy_file_range (what `cp` does) and with read/write, in the same run. Page cache,
# no fsync. UCP_BENCH_DIR picks the scratch folder (default: $TMPDIR or /tmp); it needs ~3 GiB.
set -euo pipefail
BUILD_DIR=${BUILD_DIR:-build-bench}
"$BUILD_DIR/tests/bench/executor/bench_executor" --benchmark_counters_tabular=true "$@"

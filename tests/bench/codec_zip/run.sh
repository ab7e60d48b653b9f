#!/usr/bin/env bash
# Zip codec benchmarks: CRC-32 throughput, and the zip writer streaming a 1 GiB archive from a
# source file against plain copies of the same bytes in the same run (all into the page cache,
# no fsync). UCP_BENCH_DIR picks the scratch folder (default: $TMPDIR or /tmp); it needs ~3 GiB.
set -euo pipefail
BUILD_DIR=${BUILD_DIR:-build-bench}
"$BUILD_DIR/tests/bench/codec_zip/bench_codec_zip" --benchmark_counters_tabular=true "$@"

#!/usr/bin/env bash
# XXH3-64 throughput of the kernels core/util/xxh3.h chooses between: xxHash's SSE2 baseline and
# its AVX2 kernel (when this CPU runs it), over 1 GiB held in 64 buffers of 16 MiB (the tensors of
# tests/bench/save), so the bytes come from memory as they do when torch.save writes them.
set -euo pipefail
BUILD_DIR=${BUILD_DIR:-build-bench}
"$BUILD_DIR/tests/bench/hash/bench_hash" --benchmark_counters_tabular=true "$@"

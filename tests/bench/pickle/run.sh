#!/usr/bin/env bash
# Pickle codec throughput: read, write and read+write of a torch-style state dict pickle with
# N tensors (the data.pkl a torch.save of that many tensors holds).
set -euo pipefail
"$BUILD_DIR/tests/bench/pickle/pickle_bench" --benchmark_counters_tabular=true

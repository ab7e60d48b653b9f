#!/usr/bin/env bash
# NCCL hook overhead (tests/bench/run.sh sets BUILD_DIR): the same benchmark without ucp, with
# LD_PRELOAD=libucp.so, and with the topology dump on. Compare the rows of the three tables.
set -euo pipefail
bench=$BUILD_DIR/tests/bench/nccl/ucp_nccl_bench
dump_dir=$(mktemp -d)
trap 'rm -rf "$dump_dir"' EXIT
echo "-- without ucp"
"$bench" --benchmark_repetitions=3 --benchmark_report_aggregates_only=true
echo "-- LD_PRELOAD=libucp.so"
LD_PRELOAD=$BUILD_DIR/libucp.so "$bench" --benchmark_repetitions=3 \
  --benchmark_report_aggregates_only=true
echo "-- LD_PRELOAD=libucp.so UCP_DUMP_TOPOLOGY=$dump_dir/topology.json"
LD_PRELOAD=$BUILD_DIR/libucp.so UCP_DUMP_TOPOLOGY=$dump_dir/topology.json "$bench" \
  --benchmark_repetitions=3 --benchmark_report_aggregates_only=true

#!/usr/bin/env bash
# Torch archive codec benchmark: generates a 1 GiB, 1000-tensor torch.save file under
# $BUILD_DIR/codec_archive_data with torch, runs codec_archive_bench on it, prints the writer's
# throughput as a fraction of a plain copy measured in the same run, and deletes the data.
set -euo pipefail
build_dir=${BUILD_DIR:-build-bench}
data_dir=$build_dir/codec_archive_data
archive=$data_dir/bench_1g_1000.pt
mkdir -p "$data_dir"
trap 'rm -rf "$data_dir"' EXIT
/usr/bin/python3 - "$archive" <<'PY'
import collections, sys, torch
# 1000 float32 tensors of 268,416 elements (1,073,664 bytes, a multiple of 64): 1.0 GiB.
state = collections.OrderedDict()
for i in range(1000):
    state[f"layers.{i}.weight"] = torch.full((268416,), float(i))
torch.save({"module": state, "step": 1}, sys.argv[1])
PY
json=$data_dir/result.json
UCP_BENCH_ARCHIVE=$archive "$build_dir/tests/bench/codec_archive/codec_archive_bench" \
  --benchmark_out="$json" --benchmark_out_format=json
/usr/bin/python3 - "$json" "$archive" <<'PY'
import json, os, sys
runs = {b["name"].split("/")[0]: b for b in json.load(open(sys.argv[1]))["benchmarks"]}
gib = 1 << 30
size = os.path.getsize(sys.argv[2])
print(f"archive: {size / gib:.2f} GiB, {int(runs['BM_ReadMetadata']['tensors'])} tensors")
print(f"metadata read: {runs['BM_ReadMetadata']['real_time']:.2f} ms")
writer = runs["BM_RewriteArchive"]["bytes_per_second"]
copy = runs["BM_PlainCopy"]["bytes_per_second"]
print(f"archive writer: {writer / gib:.2f} GiB/s, plain copy: {copy / gib:.2f} GiB/s, "
      f"writer/copy = {100 * writer / copy:.0f}%")
PY

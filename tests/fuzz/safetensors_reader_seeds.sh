#!/usr/bin/env bash
# Seeds the safetensors fuzz corpus (CORPUS_DIR, $1) with files written by the independent
# Python writer of the unit tests and a few hand-made headers.
set -euo pipefail
corpus=$1
source_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
mkdir -p "$corpus"
/usr/bin/python3 "$source_dir/tests/unit/core/safetensors_tool.py" write "$corpus/seed_sample" >/dev/null
/usr/bin/python3 - "$corpus" <<'PY'
import json, struct, sys
corpus = sys.argv[1]
headers = {
    "empty": ({}, b""),
    "meta": ({"__metadata__": {"a": "b"}, "t": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, b"xy"),
    "zero_d": ({"s": {"dtype": "F64", "shape": [], "data_offsets": [0, 8]}}, b"\0" * 8),
}
for name, (header, data) in headers.items():
    text = json.dumps(header).encode()
    with open(f"{corpus}/seed_{name}", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)
PY

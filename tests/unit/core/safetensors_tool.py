"""An independent safetensors reader/writer (json + numpy only) for the C++ codec's tests.

  safetensors_tool.py write OUT   writes a fixed set of tensors to OUT, prints their description
  safetensors_tool.py read IN     parses IN itself and prints its description

The description is JSON: {"metadata": {...}, "tensors": {name: {"dtype", "shape", "offset",
"size", "hex"}}}, "offset" absolute in the file, "hex" the tensor's bytes.
"""
import json
import struct
import sys

import numpy as np

ITEM_SIZE = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4,
             "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}


def sample_tensors():
    rng = np.random.default_rng(7)
    bf16 = (rng.standard_normal(6).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return [
        ("embed.weight", "F32", [3, 4], rng.standard_normal((3, 4)).astype("<f4").tobytes()),
        ("bf16 tensor ✓", "BF16", [2, 3], bf16.astype("<u2").tobytes()),
        ("half", "F16", [5], rng.standard_normal(5).astype("<f2").tobytes()),
        ("double", "F64", [2], rng.standard_normal(2).astype("<f8").tobytes()),
        ("ids", "I64", [4], np.arange(-2, 2, dtype="<i8").tobytes()),
        ("i32", "I32", [1, 2], np.array([[7, -9]], dtype="<i4").tobytes()),
        ("i16", "I16", [3], np.array([1, -1, 300], dtype="<i2").tobytes()),
        ("i8", "I8", [2], np.array([-128, 127], dtype="i1").tobytes()),
        ("u8", "U8", [2, 2], np.array([0, 1, 254, 255], dtype="u1").tobytes()),
        ("mask", "BOOL", [3], np.array([True, False, True]).tobytes()),
        ("scalar", "F32", [], np.array(2.5, dtype="<f4").tobytes()),
        ("empty", "F32", [0, 3], b""),
    ]


def write(path):
    header, offset, blobs = {"__metadata__": {"format": "pt", "source": "python"}}, 0, []
    for name, dtype, shape, data in sample_tensors():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    describe(path)


def describe(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    text = blob[8:8 + n].decode("utf-8")
    assert text.startswith("{"), "header must begin with {"
    header = json.loads(text)
    metadata = header.pop("__metadata__", {})
    start, cursor, out = 8 + n, 0, {}
    for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"]):
        begin, end = entry["data_offsets"]
        assert begin == cursor, f"hole or overlap at {name}"
        assert end - begin == int(np.prod(entry["shape"], dtype=np.int64)) * ITEM_SIZE[entry["dtype"]]
        cursor = end
        out[name] = {"dtype": entry["dtype"], "shape": entry["shape"], "offset": start + begin,
                     "size": end - begin, "hex": blob[start + begin:start + end].hex()}
    assert start + cursor == len(blob), "unindexed bytes at the end"
    json.dump({"metadata": metadata, "tensors": out}, sys.stdout, sort_keys=True)


if __name__ == "__main__":
    {"write": write, "read": describe}[sys.argv[1]](sys.argv[2])

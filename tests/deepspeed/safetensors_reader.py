"""A small safetensors reader (the safetensors package is not in Debian): the 8-byte
little-endian header length, the JSON header, then the data buffer read with numpy.

read() checks what the format requires: header within the file, data_offsets inside the buffer,
byte counts matching dtype x shape, tensors tiling the buffer with no hole and no overlap.
"""

import json
import struct

import numpy
import torch

# safetensors dtype -> (numpy dtype of the bytes, torch dtype). bf16 has no numpy type: its bytes
# are read as int16 (torch.from_numpy takes no uint16) and viewed as torch.bfloat16.
DTYPES = {
    "F64": (numpy.float64, torch.float64),
    "F32": (numpy.float32, torch.float32),
    "F16": (numpy.float16, torch.float16),
    "BF16": (numpy.int16, torch.bfloat16),
    "I64": (numpy.int64, torch.int64),
    "I32": (numpy.int32, torch.int32),
    "I16": (numpy.int16, torch.int16),
    "I8": (numpy.int8, torch.int8),
    "U8": (numpy.uint8, torch.uint8),
    "BOOL": (numpy.bool_, torch.bool),
}


class FormatError(Exception):
    pass


def read(path):
    """(tensors: name -> torch tensor, metadata dict or None) of a safetensors file."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise FormatError(f"{path}: shorter than the header length")
    (header_length,) = struct.unpack("<Q", data[:8])
    if 8 + header_length > len(data):
        raise FormatError(f"{path}: header length {header_length} beyond the file")
    header = json.loads(data[8:8 + header_length].decode("utf-8"))
    buffer = memoryview(data)[8 + header_length:]
    metadata = header.pop("__metadata__", None)
    tensors, spans = {}, []
    for name, entry in header.items():
        numpy_dtype, torch_dtype = DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        shape = entry["shape"]
        count = 1
        for extent in shape:
            count *= extent
        if not 0 <= begin <= end <= len(buffer):
            raise FormatError(f"{path}: {name}: data_offsets {begin},{end} outside the buffer")
        if end - begin != count * numpy.dtype(numpy_dtype).itemsize:
            raise FormatError(f"{path}: {name}: {end - begin} bytes for {entry['dtype']}{shape}")
        array = numpy.frombuffer(buffer[begin:end], dtype=numpy.dtype(numpy_dtype).newbyteorder("<"))
        tensor = torch.from_numpy(array.copy()).reshape(shape)
        if torch_dtype == torch.bfloat16:
            tensor = tensor.view(torch.bfloat16)
        tensors[name] = tensor
        spans.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise FormatError(f"{path}: {name} starts at {begin}, expected {position}")
        position = end
    if position != len(buffer):
        raise FormatError(f"{path}: {len(buffer) - position} bytes after the last tensor")
    return tensors, metadata

"""Round trip: ucp reads each .pt and writes it again; torch.load must give equal objects.

  check_roundtrip.py REWRITE_BINARY SCRATCH_DIR FILE_OR_DIR...

For every .pt file: runs `REWRITE_BINARY IN OUT` (C++ read → C++ write, storages streamed from
IN's byte ranges), checks OUT's zip layout is torch 1.13's (records data.pkl, data/<key> in
string order, version "3\\n"; folder = OUT's stem; data 64-byte aligned; stored), then loads both
with torch and compares them: tensors bitwise with the same dtype/shape/stride/storage offset,
objects of classes that cannot be imported by the state their stand-ins recorded, everything
else by type and value; and the sharing pattern must be the same (two places holding one object
in IN hold one object in OUT; tensors sharing a storage in IN share one in OUT).
"""
import os
import struct
import subprocess
import sys
import zipfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures"))
import check_archive  # noqa: E402  (the stand-in loader and file walker)


class Different(Exception):
    pass


class Comparer:
    def __init__(self):
        self.pairs = {}  # id(original) → id(copy), for identity
        self.storages = {}
        self.keep = []  # keeps compared objects alive so ids stay unique

    def same_identity(self, a, b, path):
        self.keep.append((a, b))
        if self.pairs.setdefault(id(a), id(b)) != id(b):
            raise Different(f"{path}: sharing differs (one object in the original, two copies)")

    def compare(self, a, b, path):
        if type(a) is not type(b) and not (isinstance(a, check_archive.StandIn) and
                                           type(a).__name__ == type(b).__name__):
            raise Different(f"{path}: type {type(a)} vs {type(b)}")
        if isinstance(a, torch.Tensor):
            self.same_identity(a, b, path)
            if (a.dtype, a.shape, a.stride(), a.storage_offset(), a.requires_grad) != \
                    (b.dtype, b.shape, b.stride(), b.storage_offset(), b.requires_grad):
                raise Different(f"{path}: tensor metadata differs")
            sa, sb = check_archive.untyped_storage(a), check_archive.untyped_storage(b)
            if _raw(sa) != _raw(sb):
                raise Different(f"{path}: storage bytes differ")
            key_a, key_b = sa._cdata, sb._cdata
            if self.storages.setdefault(key_a, key_b) != key_b:
                raise Different(f"{path}: storage sharing differs")
            return
        if a is None or type(a) in (bool, int, str, bytes, complex, torch.dtype, torch.device):
            if a != b:
                raise Different(f"{path}: {a!r} vs {b!r}")
            return
        if type(a) is float:
            if struct.pack("<d", a) != struct.pack("<d", b):
                raise Different(f"{path}: {a!r} vs {b!r}")
            return
        self.same_identity(a, b, path)
        if isinstance(a, type) or callable(a) and not hasattr(a, "__dict__"):
            if a is not b:
                raise Different(f"{path}: global {a!r} vs {b!r}")
            return
        if isinstance(a, (list, tuple)):
            if len(a) != len(b):
                raise Different(f"{path}: length {len(a)} vs {len(b)}")
            for i, (x, y) in enumerate(zip(a, b)):
                self.compare(x, y, f"{path}/{i}")
            return
        if isinstance(a, dict):
            if list(map(repr, a.keys())) != list(map(repr, b.keys())):
                raise Different(f"{path}: keys differ")
            for (ka, va), (kb, vb) in zip(a.items(), b.items()):
                self.compare(ka, kb, f"{path}/{ka!r}.key")
                self.compare(va, vb, f"{path}/{ka!r}")
            if type(a) is not dict:
                self.compare(vars(a), vars(b), f"{path}.__dict__")
            return
        if isinstance(a, (set, frozenset)):
            if a != b:
                raise Different(f"{path}: sets differ")
            return
        # Everything else by what pickling would record: the stand-in's construction, or the
        # reduction (callable, args, state, items) of importable objects, recursively.
        walker = check_archive.Walker()
        if walker.node(a) != walker.node(b):
            raise Different(f"{path}: object state differs")
        for name in ("_ucp_args", "_ucp_state", "_ucp_appends", "_ucp_setitems"):
            if hasattr(a, name):
                self.compare(getattr(a, name), getattr(b, name), f"{path}.{name}")
        if hasattr(a, "__dict__") and not isinstance(a, check_archive.StandIn):
            self.compare(vars(a), vars(b), f"{path}.__dict__")


def _raw(untyped):
    """The storage's bytes (a uint8 tensor set onto the untyped storage)."""
    return torch.empty(0, dtype=torch.uint8).set_(untyped).numpy().tobytes()


def check_layout(path):
    stem = os.path.splitext(os.path.basename(path))[0]
    with zipfile.ZipFile(path) as archive, open(path, "rb") as raw:
        names = [info.filename for info in archive.infolist()]
        keys = [name[len(stem) + 6:] for name in names[1:-1]]
        expected = [f"{stem}/data.pkl"] + [f"{stem}/data/{k}" for k in sorted(keys)] + \
            [f"{stem}/version"]
        if names != expected:
            raise Different(f"record order {names} is not torch's {expected}")
        if archive.read(f"{stem}/version") != b"3\n":
            raise Different("version record is not 3")
        for info in archive.infolist():
            raw.seek(info.header_offset)
            header = raw.read(30)
            name_length, extra_length = struct.unpack("<HH", header[26:30])
            start = info.header_offset + 30 + name_length + extra_length
            if start % 64 or info.compress_type != zipfile.ZIP_STORED:
                raise Different(f"{info.filename}: data at {start} not 64-aligned or not stored")
        if archive.testzip() is not None:
            raise Different("CRC mismatch")


def main():
    binary, scratch = sys.argv[1], sys.argv[2]
    os.makedirs(scratch, exist_ok=True)
    count = 0
    for path in check_archive.files(sys.argv[3:]):
        out = os.path.join(scratch, os.path.basename(path))
        result = subprocess.run([binary, path, out], capture_output=True, check=False)
        try:
            if result.returncode != 0:
                raise Different(f"rewrite failed: {result.stderr.decode()}")
            check_layout(out)
            Comparer().compare(check_archive.load(path), check_archive.load(out), "")
        except Different as error:
            print(f"DIFFERENT {path}: {error}")
            return 1
        os.unlink(out)
        count += 1
    print(f"ok: {count} files round-trip through ucp's reader and writer")
    return 0 if count else 1


if __name__ == "__main__":
    sys.exit(main())

"""Loading and comparing DeepSpeed checkpoint files without DeepSpeed.

DeepSpeed's three pickled classes are mapped to small stand-ins that keep their state, so that
files can be loaded, compared and edited (save() pickles the stand-ins under DeepSpeed's names).

compare() walks two loaded objects and lists every difference: types (OrderedDict is not dict,
torch.Size is not tuple), dict keys in order, floats by their bits, tensors by dtype, shape,
stride, storage offset and bits (integer views, so NaN and -0.0 count), and whether tensors share
storages the same way.
"""

import argparse
import enum
import struct
import sys
import types

import torch


class LossScaler:
    """deepspeed.runtime.fp16.loss_scaler.LossScaler: NEWOBJ + BUILD of its __dict__."""

    def __eq__(self, other):
        return type(other) is type(self) and vars(self) == vars(other)

    def __repr__(self):
        return f"LossScaler({vars(self)})"


class fragment_address:  # noqa: N801 (DeepSpeed's name)
    """deepspeed.utils.tensor_fragment.fragment_address: a dataclass (numel, start)."""

    def __eq__(self, other):
        return type(other) is type(self) and vars(self) == vars(other)

    def __repr__(self):
        return f"fragment_address({vars(self)})"


class ZeroStageEnum(enum.IntEnum):
    """deepspeed.runtime.zero.config.ZeroStageEnum, pickled as getattr(ZeroStageEnum, name)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3

    def __reduce_ex__(self, protocol):
        return getattr, (type(self), self.name)


STAND_INS = {
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"): LossScaler,
    ("deepspeed.utils.tensor_fragment", "fragment_address"): fragment_address,
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): ZeroStageEnum,
}


# Debian's torch 1.13 torch.load replaces any pickle_module it is given by pickle, so the
# stand-ins are found by name: modules of DeepSpeed's names holding them are registered in
# sys.modules, and the classes carry DeepSpeed's module and class names so that torch.save pickles
# them as DeepSpeed does. This process never imports the real DeepSpeed.
def _register_stand_ins():
    for (module, name), cls in STAND_INS.items():
        parts = module.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            sys.modules.setdefault(prefix, types.ModuleType(prefix))
        setattr(sys.modules[module], name, cls)
        cls.__module__ = module
        cls.__qualname__ = name


_register_stand_ins()


def load(path):
    """torch.load of a DeepSpeed file on the CPU, DeepSpeed classes as stand-ins (unpickled as
    such: torch 2.6 and later load only plain tensors and containers by default)."""
    return torch.load(path, map_location="cpu", weights_only=False)


def save(obj, path):
    """torch.save pickling the stand-ins under DeepSpeed's names (protocol 2, as DeepSpeed)."""
    torch.save(obj, path, pickle_protocol=2)


def _bits(t):
    size = t.element_size()
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    if t.is_floating_point() or t.is_complex():
        view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
        return t.view(view)
    return t


def _float_bits(x):
    return struct.pack("<d", x)


def compare(a, b, path="", allowed=(), unordered=None, out=None, storages=None):
    """Differences between a and b as a list of 'path: what' strings.

    `allowed` lists paths ('ds_config.checkpoint.load_universal', ...) whose values are not
    compared; dicts at paths matching the regex `unordered` are compared without their key order.
    Storage sharing is checked across the whole walk: a storage first seen in `a` together with a
    storage of `b` must pair with that one everywhere.
    """
    if out is None:
        out = []
    if storages is None:
        storages = ({}, {})
    if path in allowed:
        return out
    where = path or "<root>"
    if type(a) is not type(b):
        out.append(f"{where}: type {type(a).__name__} vs {type(b).__name__}")
        return out
    if isinstance(a, torch.Tensor):
        _compare_tensors(a, b, where, out, storages)
    elif isinstance(a, dict):
        keys_a, keys_b = list(a.keys()), list(b.keys())
        if unordered is not None and unordered.match(path):
            keys_a, keys_b = sorted(keys_a, key=repr), sorted(keys_b, key=repr)
        if keys_a != keys_b:
            out.append(f"{where}: keys {keys_a} vs {keys_b}")
        for key in keys_a:
            if key in b:
                compare(a[key], b[key], _join(path, key), allowed, unordered, out, storages)
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            out.append(f"{where}: length {len(a)} vs {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            compare(x, y, _join(path, i), allowed, unordered, out, storages)
    elif isinstance(a, float):
        if _float_bits(a) != _float_bits(b):
            out.append(f"{where}: {a!r} vs {b!r}")
    elif isinstance(a, (LossScaler, fragment_address, argparse.Namespace)):
        compare(vars(a), vars(b), path, allowed, unordered, out, storages)
    elif a != b:
        out.append(f"{where}: {a!r} vs {b!r}")
    return out


def _join(path, key):
    return f"{path}.{key}" if path else str(key)


def _compare_tensors(a, b, where, out, storages):
    if a.dtype != b.dtype or a.shape != b.shape:
        out.append(f"{where}: tensor {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
        return
    if a.stride() != b.stride() or a.storage_offset() != b.storage_offset():
        out.append(f"{where}: stride/offset {a.stride()}@{a.storage_offset()} vs "
                   f"{b.stride()}@{b.storage_offset()}")
    if a.storage().nbytes() != b.storage().nbytes():
        out.append(f"{where}: storage bytes {a.storage().nbytes()} vs {b.storage().nbytes()}")
    if a.requires_grad != b.requires_grad:
        out.append(f"{where}: requires_grad {a.requires_grad} vs {b.requires_grad}")
    equal = torch.equal(_bits(a), _bits(b))
    if not equal:
        differing = (_bits(a) != _bits(b)).sum().item()
        out.append(f"{where}: {differing} of {a.numel()} elements differ")
    pa, pb = a.storage().data_ptr(), b.storage().data_ptr()
    seen_a, seen_b = storages
    first = pa not in seen_a
    if seen_a.setdefault(pa, pb) != pb or seen_b.setdefault(pb, pa) != pa:
        out.append(f"{where}: storage shared differently")
    elif first and equal and a.storage().nbytes() == b.storage().nbytes():
        # The bytes a file holds beyond the views (the stripped padding of a partition).
        whole_a = torch.empty(0, dtype=a.dtype).set_(a.storage())
        whole_b = torch.empty(0, dtype=b.dtype).set_(b.storage())
        if not torch.equal(_bits(whole_a), _bits(whole_b)):
            out.append(f"{where}: storage bytes outside the tensor differ")

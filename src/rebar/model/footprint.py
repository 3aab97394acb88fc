"""How much memory a loaded model's tensors hold, for memory budgets.

Quantized layers keep their weights in plain attributes (packed operands, block weights), not only
in registered parameters and buffers, so the count walks every object a module reaches and adds
each tensor storage once.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import torch
from torch import nn

_ATOMS = (str, bytes, int, float, bool, type(None), torch.dtype, torch.device, type)
# Code, not data: a function's globals would lead everywhere.
_CODE = (
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    types.ModuleType,
    types.CodeType,
)


def tensor_bytes(root: nn.Module) -> int:
    """Bytes of every distinct tensor storage reachable from `root`'s modules and their attributes
    (views and shared storages counted once; memory-mapped weights at their full size)."""
    seen_objects: set[int] = set()
    seen_storages: set[tuple[str, int]] = set()
    total = 0
    stack: list[Any] = [root]
    while stack:
        obj = stack.pop()
        if isinstance(obj, _ATOMS + _CODE) or id(obj) in seen_objects:
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            key = (str(obj.device), storage.data_ptr())
            if key not in seen_storages and storage.nbytes():
                seen_storages.add(key)
                total += storage.nbytes()
            continue
        stack.extend(_children(obj))
    return total


def _children(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    if isinstance(obj, nn.Module):
        return list(vars(obj).values())  # _parameters, _buffers, _modules and plain attributes
    if dataclasses.is_dataclass(obj):
        return [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    if hasattr(obj, "__dict__"):
        return list(vars(obj).values())
    slots = getattr(type(obj), "__slots__", ())
    return [getattr(obj, name) for name in slots if hasattr(obj, name)]

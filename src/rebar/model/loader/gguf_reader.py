"""A lean GGUF (v2/v3) reader: header, metadata and tensor index, with tensor data memory-mapped.

The `gguf` package's reader builds a numpy view per metadata string, which takes seconds for a
50k-token vocabulary; this reader parses the header with `struct` in one pass over a memory map
and returns plain Python values. Type ids and block sizes still come from `gguf` itself.
"""

from __future__ import annotations

import math
import mmap
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from rebar.errors import ModelFormatError, UnsupportedModelError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> struct format (scalars); 8 = string, 9 = array.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # numpy/torch order: outermost first (GGML's ne reversed)
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    num_bytes: int

    def data(self, buffer: np.ndarray) -> np.ndarray:
        """The tensor's bytes as GGML readers expect them: typed for F32/F16, else [rows..., bytes per row] uint8."""
        raw = buffer[self.offset : self.offset + self.num_bytes]
        if self.qtype == GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(self.shape)
        if self.qtype == GGMLQuantizationType.F16:
            return raw.view(np.float16).reshape(self.shape)
        return raw.reshape(*self.shape[:-1], -1)


class _Cursor:
    def __init__(self, data: mmap.mmap, path: Path) -> None:
        self.data, self.pos, self.path = data, 0, path

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise ModelFormatError(f"{self.path} is truncated (header ends at byte {len(self.data)})")
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        start, end = self.pos, self.pos + length
        if end > len(self.data):
            raise ModelFormatError(f"{self.path} is truncated inside a string at byte {start}")
        raw = self.data[start:end]
        self.pos = end
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ModelFormatError(f"{self.path}: a metadata string at byte {start} is not UTF-8") from exc

    def value(self, value_type: int) -> Any:
        if value_type in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if item_type in _SCALAR_FORMATS:  # numeric arrays in one call
                fmt = _SCALAR_FORMATS[item_type]
                size = struct.calcsize(fmt) * count
                if self.pos + size > len(self.data):
                    raise ModelFormatError(f"{self.path} is truncated inside an array")
                items = list(struct.unpack_from(f"<{count}{fmt[1]}", self.data, self.pos))
                self.pos += size
                return items
            return [self.value(item_type) for _ in range(count)]
        raise ModelFormatError(f"{self.path}: unknown metadata value type {value_type} at byte {self.pos}")


class GGUFFile:
    """An open GGUF file: `metadata` (key -> value), `tensors` (name -> GGUFTensor), `buffer` (the mapping)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as handle:
                mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:  # ValueError: empty file
            raise ModelFormatError(f"cannot map {path}: {exc}") from exc
        self._mapped = mapped
        self.buffer = np.frombuffer(mapped, dtype=np.uint8)
        cursor = _Cursor(mapped, path)
        if mapped[:4] != GGUF_MAGIC:
            raise ModelFormatError(f"{path} is not a GGUF file (bad magic {bytes(mapped[:4])!r})")
        cursor.pos = 4
        version = cursor.unpack("<I")
        if version not in (2, 3):
            raise UnsupportedModelError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
        num_tensors, num_kv = cursor.unpack("<Q"), cursor.unpack("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = cursor.string()
            if key in self.metadata:
                raise ModelFormatError(f"{path}: metadata key {key!r} appears twice")
            self.metadata[key] = cursor.value(cursor.unpack("<I"))
        infos = [self._tensor_info(cursor) for _ in range(num_tensors)]
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ModelFormatError(f"{path}: general.alignment must be a power of two, got {alignment!r}")
        data_start = -(-cursor.pos // alignment) * alignment
        self.tensors: dict[str, GGUFTensor] = {}
        for name, shape, qtype, relative in infos:
            if name in self.tensors:
                raise ModelFormatError(f"{path}: tensor {name!r} appears twice in the tensor index")
            tensor = GGUFTensor(name, shape, qtype, data_start + relative, _num_bytes(name, shape, qtype))
            if tensor.offset + tensor.num_bytes > len(mapped):
                raise ModelFormatError(
                    f"{path} is truncated: tensor {name!r} needs bytes up to {tensor.offset + tensor.num_bytes}, "
                    f"the file has {len(mapped)}"
                )
            self.tensors[name] = tensor

    def raw_rows(self, tensor: GGUFTensor) -> torch.Tensor:
        """The tensor's bytes as uint8 `[rows, bytes per row]`, a view of the mapping (no copy; read-only
        memory: never write to it)."""
        rows = math.prod(tensor.shape[:-1])
        with warnings.catch_warnings():  # torch warns that the mapping is not writable; it is never written
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(self._mapped, dtype=torch.uint8, count=tensor.num_bytes, offset=tensor.offset)
        return flat.view(rows, -1)

    def release(self, tensor: GGUFTensor) -> None:
        """Drop the tensor's pages from this process's resident memory (once its bytes have been copied
        or packed elsewhere); a later read maps them in again from the page cache."""
        self._release_bytes(tensor.offset, tensor.offset + tensor.num_bytes)

    def release_view(self, view: torch.Tensor) -> None:
        """`release` for part of a tensor: `view`, a contiguous slice of what `raw_rows` returned (a
        vocabulary-sized embedding packed a chunk at a time then never holds all its file pages)."""
        if not view.is_contiguous():
            raise ValueError("only a contiguous view of the mapping can be released")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            base = torch.frombuffer(self._mapped, dtype=torch.uint8, count=1).data_ptr()
        start = view.data_ptr() - base
        end = start + view.numel() * view.element_size()
        if start < 0 or end > len(self._mapped):
            raise ValueError("the view is not part of this file's mapping")
        self._release_bytes(start, end)

    def _release_bytes(self, start: int, end: int) -> None:
        page = mmap.PAGESIZE
        start = start // page * page
        end = min(len(self._mapped), -(-end // page) * page)
        if hasattr(mmap, "MADV_DONTNEED") and end > start:
            self._mapped.madvise(mmap.MADV_DONTNEED, start, end - start)

    @staticmethod
    def _tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = cursor.string()
        num_dims = cursor.unpack("<I")
        ggml_dims = [cursor.unpack("<Q") for _ in range(num_dims)]
        type_id = cursor.unpack("<I")
        offset = cursor.unpack("<Q")
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise UnsupportedModelError(f"tensor {name!r} has unknown GGML type id {type_id}") from None
        return name, tuple(reversed(ggml_dims)), qtype, offset


def _num_bytes(name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    row = shape[-1] if shape else 1
    if row % block_size:
        raise ModelFormatError(f"tensor {name!r}: row length {row} is not a multiple of {qtype.name}'s block {block_size}")
    count = math.prod(shape)  # Python ints: a corrupt shape cannot wrap around to a small size
    return count // block_size * type_size

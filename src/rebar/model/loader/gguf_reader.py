"""A lean GGUF (v2/v3) reader: header, metadata and tensor index, with tensor data memory-mapped.

The `gguf` package's reader builds a numpy view per metadata string, which takes seconds for a
50k-token vocabulary; this reader parses the header with `struct` in one pass over a memory map
(the metadata in gguf_metadata.py) and returns plain Python values. Type ids and block sizes still
come from `gguf` itself. Whatever the header claims is checked against the file before it is used:
counts against the bytes left, each tensor's bytes against the file's end, its offset against the
alignment and the other tensors.
"""

from __future__ import annotations

import itertools
import math
import mmap
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from rebar.errors import ModelFormatError, UnsupportedModelError
from rebar.model.loader.gguf_metadata import Cursor, read_metadata

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGML tensors have at most four dimensions. The fewest bytes one entry takes, to bound the counts
# in the header: a tensor's (its name's length, dimension count, type id, offset) and a metadata
# entry's (its key's length, value type, a one-byte value).
MAX_TENSOR_DIMS = 4
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8
MIN_METADATA_ENTRY_BYTES = 8 + 4 + 1
# (name, shape in torch order, type, offset in the data section) of one tensor index entry
_TensorInfo = tuple[str, tuple[int, ...], GGMLQuantizationType, int]


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # numpy/torch order: outermost first (GGML's ne reversed)
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    num_bytes: int

    def data(self, buffer: np.ndarray) -> np.ndarray:
        """The tensor's bytes as GGML readers expect them: typed for F32/F16, else [rows..., bytes
        per row] uint8."""
        raw = buffer[self.offset : self.offset + self.num_bytes]
        if self.qtype == GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(self.shape)
        if self.qtype == GGMLQuantizationType.F16:
            return raw.view(np.float16).reshape(self.shape)
        return raw.reshape(*self.shape[:-1], -1)


class GGUFFile:
    """An open GGUF file: `metadata` (key -> value), `tensors` (name -> GGUFTensor), `buffer` (the
    mapping)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as handle:
                mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:  # ValueError: empty file
            raise ModelFormatError(f"cannot map {path}: {exc}") from exc
        self._mapped = mapped
        self.buffer = np.frombuffer(mapped, dtype=np.uint8)
        cursor = Cursor(mapped, path)
        if mapped[:4] != GGUF_MAGIC:
            raise ModelFormatError(f"{path} is not a GGUF file (bad magic {bytes(mapped[:4])!r})")
        cursor.pos = 4
        version = cursor.unpack("<I", "the GGUF version")
        if version not in (2, 3):
            raise UnsupportedModelError(
                f"{path}: GGUF version {version} is not supported (2 and 3 are)"
            )
        num_tensors = cursor.unpack("<Q", "the tensor count")
        num_kv = cursor.count(MIN_METADATA_ENTRY_BYTES, "the metadata count")
        self.metadata: dict[str, Any] = read_metadata(cursor, num_kv)
        cursor.check_fits(
            num_tensors, MIN_TENSOR_INFO_BYTES, "the tensor index"
        )  # the index follows the metadata
        infos = [_tensor_info(cursor, index) for index in range(num_tensors)]
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if (
            type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1)
        ):  # bool is no alignment
            raise ModelFormatError(
                f"{path}: general.alignment must be a power of two, got {alignment!r}"
            )
        self.tensors = self._place(infos, -(-cursor.pos // alignment) * alignment, alignment)

    def _place(
        self, infos: list[_TensorInfo], data_start: int, alignment: int
    ) -> dict[str, GGUFTensor]:
        """The index's tensors at their places in the file, each aligned, inside the file and
        apart."""
        tensors: dict[str, GGUFTensor] = {}
        for name, shape, qtype, relative in infos:
            if name in tensors:
                raise ModelFormatError(
                    f"{self.path}: tensor {name!r} appears twice in the tensor index"
                )
            if relative % alignment:
                raise ModelFormatError(
                    f"{self.path}: tensor {name!r} starts at data offset {relative}, which is "
                    f"not a multiple of the alignment {alignment}"
                )
            tensors[name] = GGUFTensor(
                name, shape, qtype, data_start + relative, _num_bytes(name, shape, qtype)
            )
        in_order = sorted(tensors.values(), key=lambda t: t.offset)
        for tensor in in_order:  # in file order, so that a cut file names the tensor it cut
            if tensor.offset + tensor.num_bytes > len(self._mapped):
                raise ModelFormatError(
                    f"{self.path} is truncated: tensor {tensor.name!r} needs bytes up to "
                    f"{tensor.offset + tensor.num_bytes}, the file has {len(self._mapped)}"
                )
        for before, after in itertools.pairwise(in_order):
            if after.offset < before.offset + before.num_bytes:
                raise ModelFormatError(
                    f"{self.path}: tensors {before.name!r} and {after.name!r} overlap "
                    f"(bytes {after.offset}..{before.offset + before.num_bytes})"
                )
        return tensors

    def raw_rows(self, tensor: GGUFTensor) -> torch.Tensor:
        """The tensor's bytes as uint8 `[rows, bytes per row]`, a view of the mapping (no copy;
        read-only memory: never write to it)."""
        rows = math.prod(tensor.shape[:-1])
        with (
            warnings.catch_warnings()
        ):  # torch warns that the mapping is not writable; it is never written
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(
                self._mapped, dtype=torch.uint8, count=tensor.num_bytes, offset=tensor.offset
            )
        return flat.view(rows, -1)

    def release(self, tensor: GGUFTensor) -> None:
        """Drop the tensor's pages from this process's resident memory (once its bytes have been
        copied or packed elsewhere); a later read maps them in again from the page cache."""
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


def _tensor_info(cursor: Cursor, index: int) -> _TensorInfo:
    """The tensor index's next entry."""
    name = cursor.string(f"the name of tensor {index} in the tensor index")
    what = f"the index entry of tensor {name!r}"
    num_dims = cursor.unpack("<I", what)
    if num_dims > MAX_TENSOR_DIMS:
        raise ModelFormatError(
            f"{cursor.path}: tensor {name!r} has {num_dims} dimensions; GGUF tensors have at "
            f"most {MAX_TENSOR_DIMS}"
        )
    ggml_dims = [cursor.unpack("<Q", what) for _ in range(num_dims)]
    type_id = cursor.unpack("<I", what)
    offset = cursor.unpack("<Q", what)
    try:
        qtype = GGMLQuantizationType(type_id)
    except ValueError:
        raise UnsupportedModelError(f"tensor {name!r} has unknown GGML type id {type_id}") from None
    return name, tuple(reversed(ggml_dims)), qtype, offset


def _num_bytes(name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    row = shape[-1] if shape else 1
    if row % block_size:
        raise ModelFormatError(
            f"tensor {name!r}: row length {row} is not a "
            f"multiple of {qtype.name}'s block {block_size}"
        )
    count = math.prod(shape)  # Python ints: a corrupt shape cannot wrap around to a small size
    return count // block_size * type_size

"""GGUF's key/value metadata, parsed with `struct` from a memory map into plain Python values.

Every count and length in the file is checked against the bytes the file actually has before
anything is read or allocated, and arrays may nest only `MAX_ARRAY_DEPTH` deep: a corrupt or hostile
header (an array claiming 2**60 items, arrays nested thousands deep, a file cut anywhere) is a
ModelFormatError that names what was being read, never a RecursionError, a MemoryError or a hang.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

from rebar.errors import ModelFormatError

# llama.cpp reads arrays of scalars and strings only; a little nesting is tolerated, more is an
# attack.
MAX_ARRAY_DEPTH = 8

# GGUF metadata value types -> struct format (scalars); 8 = string, 9 = array.
SCALAR_FORMATS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
STRING, ARRAY = 8, 9
# The fewest bytes one value of each type takes: scalars their size, a string its 8-byte length, an
# array its 4-byte item type and 8-byte count. A count is refused when that many could not fit.
MIN_BYTES = {value_type: struct.calcsize(fmt) for value_type, fmt in SCALAR_FORMATS.items()} | {
    STRING: 8,
    ARRAY: 12,
}
_LENGTH = struct.Struct("<Q")


class Cursor:
    """A read position in a mapped file. Every read stays inside the file or raises a
    ModelFormatError naming the file and `what` was being read when it ended."""

    def __init__(self, data: mmap.mmap, path: Path) -> None:
        self.data, self.pos, self.path = data, 0, path

    @property
    def remaining(self) -> int:
        return len(self.data) - self.pos

    def truncated(self, what: str, needed: int) -> ModelFormatError:
        return ModelFormatError(
            f"{self.path} is truncated: {what} at byte {self.pos} needs {needed} bytes, "
            f"the file has {max(self.remaining, 0)} left"
        )

    def unpack(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        if size > self.remaining:
            raise self.truncated(what, size)
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return value

    def count(self, item_bytes: int, what: str) -> int:
        """A uint64 count of things that take at least `item_bytes` each; refused when the rest of
        the file could not hold that many (so no loop or allocation ever follows a forged count)."""
        count = self.unpack("<Q", what)
        self.check_fits(count, item_bytes, what)
        return count

    def check_fits(self, count: int, item_bytes: int, what: str) -> None:
        if count * item_bytes > self.remaining:
            raise ModelFormatError(
                f"{self.path} is truncated or corrupt: {what} claims {count} entries, more than "
                f"the {max(self.remaining, 0)} bytes left after byte {self.pos} can hold"
            )

    def string(self, what: str) -> str:
        if self.remaining < 8:
            raise self.truncated(f"the length of {what}", 8)
        (length,) = _LENGTH.unpack_from(self.data, self.pos)
        start = self.pos + 8
        end = start + length
        if end > len(self.data):
            self.pos = start
            raise self.truncated(f"the {length}-byte string of {what}", length)
        raw = self.data[start:end]
        self.pos = end
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ModelFormatError(
                f"{self.path}: {what} holds a string at byte {start} that is not UTF-8"
            ) from exc


def read_metadata(cursor: Cursor, num_kv: int) -> dict[str, Any]:
    """`num_kv` key/value pairs from the cursor's position on."""
    metadata: dict[str, Any] = {}
    for index in range(num_kv):
        key = cursor.string(f"the key of metadata entry {index}")
        if key in metadata:
            raise ModelFormatError(f"{cursor.path}: metadata key {key!r} appears twice")
        value_type = cursor.unpack("<I", f"the value type of metadata {key!r}")
        metadata[key] = _value(cursor, value_type, key)
    return metadata


def _value(cursor: Cursor, value_type: int, key: str) -> Any:
    what = f"metadata {key!r}"
    if value_type in SCALAR_FORMATS:
        return cursor.unpack(SCALAR_FORMATS[value_type], what)
    if value_type == STRING:
        return cursor.string(what)
    if value_type == ARRAY:
        return _array(cursor, key, depth=1)
    raise ModelFormatError(
        f"{cursor.path}: unknown metadata value type {value_type} for {what} at byte {cursor.pos}"
    )


def _array(cursor: Cursor, key: str, depth: int) -> list[Any]:
    """An array (the `depth`-th nested one) of `key`'s value."""
    what = f"the array in metadata {key!r}"
    if depth > MAX_ARRAY_DEPTH:
        raise ModelFormatError(
            f"{cursor.path}: metadata {key!r} nests arrays more than {MAX_ARRAY_DEPTH} deep"
        )
    item_type = cursor.unpack("<I", what)
    if item_type not in MIN_BYTES:
        raise ModelFormatError(
            f"{cursor.path}: unknown metadata value type {item_type} for the items of {what}"
        )
    count = cursor.count(MIN_BYTES[item_type], what)
    if item_type in SCALAR_FORMATS:  # numeric arrays in one call
        fmt = SCALAR_FORMATS[item_type]
        items = list(struct.unpack_from(f"<{count}{fmt[1]}", cursor.data, cursor.pos))
        cursor.pos += count * MIN_BYTES[item_type]
        return items
    if item_type == STRING:
        return [cursor.string(what) for _ in range(count)]
    return [_array(cursor, key, depth + 1) for _ in range(count)]

"""The floating-point dtypes rebar computes and stores in, by name: the one table both the settings
(`models.dtype`, `engine.kv_cache_dtype`) and the engine (which maps each name to its torch dtype)
read."""

from __future__ import annotations

from typing import Literal, get_args

DtypeName = Literal["float32", "float16", "bfloat16"]  # each the name of a torch dtype
DTYPE_NAMES: tuple[str, ...] = get_args(DtypeName)

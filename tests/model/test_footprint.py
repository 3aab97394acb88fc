"""`tensor_bytes`: every tensor storage a model reaches, once, wherever it is kept."""

from __future__ import annotations

import torch
from torch import nn

from markers import requires_smollm2
from rebar.model.footprint import tensor_bytes


def test_parameters_and_buffers_are_counted_exactly() -> None:
    layer = nn.Linear(4, 8)  # 32 weights + 8 biases, float32
    layer.register_buffer("scale", torch.zeros(3, dtype=torch.float16))
    assert tensor_bytes(layer) == (32 + 8) * 4 + 3 * 2


def test_views_and_shared_storages_count_once_and_plain_attributes_count() -> None:
    class Packed:
        """A kernel's operands kept outside the module's registered tensors."""

        def __init__(self, data: torch.Tensor) -> None:
            self.data, self.view = data, data[: data.numel() // 2]

        def __call__(self, x):  # callable objects (kernels) are still walked
            return x

    model = nn.Module()
    model.kernels = (Packed(torch.zeros(100, dtype=torch.uint8)),)
    model.tied = nn.Linear(2, 2, bias=False)
    model.also = model.tied  # the same submodule twice
    model.lookup = {"table": torch.zeros(10, dtype=torch.float64)}
    assert tensor_bytes(model) == 100 + 2 * 2 * 4 + 10 * 8


@requires_smollm2
def test_a_quantized_model_counts_its_file_and_its_repacked_operands() -> None:
    from rebar.llm import LLM
    from rebar.model.resolve import resolve_model_path

    llm = LLM("smollm2", max_model_len=256, kv_cache_memory=2**24)
    size = resolve_model_path("smollm2").stat().st_size
    assert size * 0.9 < llm.weight_bytes < size * 3
    assert llm.footprint_bytes == llm.weight_bytes + llm.kv_cache_bytes
    assert llm.kv_cache_bytes <= 2**24

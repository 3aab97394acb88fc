"""The Llama-family model's fused CPU decode step: every decoder layer in one C++ call.

A decode step of a small model is thousands of tiny operations around seven matmuls per layer; from
Python each costs microseconds of dispatch, several times the arithmetic. `FusedDecoder` hands the
whole layer stack of a pure-decode step (every sequence adds one token) to the compiled kernels
(`csrc/decoder.cpp`): the same int8-activation quantized matmuls QuantLinear runs (every GGUF
block type), with norms, RoPE, the KV-cache write and paged attention in between (over a
float32, float16 or Q8_0 cache), on rebar's worker pool; the family's variations too (q/k norms,
Gemma 3's sandwich norms, GeGLU, per-layer sliding windows and RoPE tables). The embedding
lookup, the final norm and the logits stay in the model's own Python code.

It applies only where it computes the same function as the model: a `LlamaModel` in float32 on the
CPU whose every layer linear runs on rebar's CPU kernels; `FusedDecoder.build` returns the reason
otherwise, and the runner keeps the plain model path. It reads each linear's weights through
`QuantLinear.native_operands()`, the same packed weights the linear's own forward multiplies with.
Outputs agree with the unfused model to float32 round-off (tests/model/test_fused_decode.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rebar.kernels import kv_quant
from rebar.kernels.attention import AttentionMetadata, KVCache
from rebar.model.llama import LlamaModel
from rebar.weights.qlinear import NativeOperands, QuantLinear

PROFILE_RANGE = "fused_decode_step"
_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # csrc/decoder.h, Activation
_LINEARS = (
    "attn.q_proj",
    "attn.k_proj",
    "attn.v_proj",
    "attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


@dataclass(frozen=True)
class BuildOutcome:
    decoder: FusedDecoder | None
    reason: str  # why decoder is None; "" when built


class FusedDecoder:
    """Runs a pure-decode step of `model` over `kv_cache` in one call; see the module docstring."""

    def __init__(self, model: LlamaModel, kv_cache: KVCache, extension) -> None:
        config = model.config
        self.model = model
        operands = [
            [_native_operands(layer, path) for path in _LINEARS] for layer in model.decoder_layers()
        ]
        # The runner sends steps of at most this many one-token rows: as many as every layer
        # linear's CPU kernel serves in the model's own path (any number, unless a test pins another
        # plan), so a decode row's numbers do not depend on which path its step took.
        self.max_rows = min(linear.max_rows for layer in operands for linear in layer)
        self._decoder = extension.FusedDecoder(
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.intermediate_size,
            float(config.norm_eps),
            float(config.softmax_scale),
            int(config.sliding_window or 0),
            _ACTIVATIONS[config.activation],
        )
        for index, layer in enumerate(model.decoder_layers()):
            linears = [(linear.packed.kernel_args(), linear.bias) for linear in operands[index]]
            norms = [
                None if norm is None else norm.weight.detach()
                for norm in (
                    layer.attn.q_norm,
                    layer.attn.k_norm,
                    layer.attn_out_norm,
                    layer.mlp_out_norm,
                )
            ]
            self._decoder.add_layer(
                layer.input_norm.weight.detach(),
                layer.post_attn_norm.weight.detach(),
                kv_cache.keys[index],
                kv_cache.values[index],
                linears,
                norms,
                config.layer_window(index) is not None,
                model.is_local[index],
            )

    @classmethod
    def build(cls, model: torch.nn.Module, kv_cache: KVCache) -> BuildOutcome:
        """A decoder for `model`, or None and the reason it cannot compute the same function."""
        reason = unsupported_reason(model, kv_cache)
        if reason:
            return BuildOutcome(None, reason)
        assert isinstance(model, LlamaModel)
        from rebar.kernels.cpu_quant.build import load_extension

        return BuildOutcome(cls(model, kv_cache, load_extension().module), "")

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states [rows, hidden] after the final norm, like `model(...)`; writes this step's
        K/V. Every row of `meta` must add one token."""
        model = self.model
        x = model.embed(input_ids).float().contiguous()
        (cos, sin), (local_cos, local_sin) = model.rope_tables(positions, torch.float32)
        # One range in a profile (rebar profile, /admin/profile) where the model's path has one per
        # layer.
        with torch.profiler.record_function(PROFILE_RANGE):
            self._decoder.step(
                x,
                cos,
                sin,
                local_cos,
                local_sin,
                meta.slot_mapping,
                meta.block_tables,
                list(meta.context_lens),
            )
        return model.norm(x)


def _native_operands(layer: torch.nn.Module, path: str) -> NativeOperands:
    module = layer.get_submodule(path)
    operands = module.native_operands() if isinstance(module, QuantLinear) else None
    assert operands is not None, "unsupported_reason checks every layer linear"
    return operands


def unsupported_reason(model: torch.nn.Module, kv_cache: KVCache) -> str:
    """Why the fused step cannot stand in for `model`'s decode steps, or "" when it can."""
    if type(model) is not LlamaModel:
        return f"{type(model).__name__} is not a Llama-family decoder"
    if (
        kv_cache.dtype not in (torch.float32, torch.float16, kv_quant.STORAGE_DTYPE)
        or kv_cache.keys[0].device.type != "cpu"
    ):
        return (
            f"the KV cache is {kv_cache.dtype} on "
            f"{kv_cache.keys[0].device}, not float32, float16 or {kv_quant.NAME} on the CPU"
        )
    if model.config.head_dim % 8:
        return (
            f"head_dim {model.config.head_dim} is not a "
            "multiple of 8 (the attention's vector width)"
        )
    dtype = model.decoder_layers()[0].input_norm.weight.dtype
    if dtype != torch.float32:
        return f"the model runs in {dtype}, not float32"
    for index, layer in enumerate(model.layers):
        for path in _LINEARS:
            module = layer.get_submodule(path)
            name = f"layers.{index}.{path}"
            if not isinstance(module, QuantLinear):
                return f"{name} is not quantized"
            if module.native_operands() is None:
                return f"{name} does not run on rebar's CPU kernels ({module.decode_kernel_name})"
    return ""

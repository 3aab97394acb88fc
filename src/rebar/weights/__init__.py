"""The weight formats a loaded model runs with: rebar's int4 / int8 codes (`int_formats`), GGUF's
block types (`block_weight`), the quantized linear and embedding that run them (`qlinear`) and the
handler that swaps them into a built model (`handler`).

A leaf under the model: loaders produce these weights and the model runs them, but nothing here
imports `rebar.model`. The offline tools that make quantized checkpoints live in `rebar.quant`.
"""

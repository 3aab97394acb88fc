"""SiLU-and-multiply and rotary embeddings for the model's own forward, compiled on the CPU.

In a prefill the matmuls run on rebar's int4/int8 kernels, and what remains is element-wise torch
work between them. Six operators for RoPE and two for SiLU-and-multiply each made a full pass over
tensors larger than the cache; here each is one pass, split over torch's threads
(csrc/elementwise.cpp, the same code the fused decode step runs).

The compiled path is taken for float32 CPU tensors that need no gradient, once rebar's CPU kernels
are loaded in this process (building a model with quantized CPU linears loads them). Nothing here
builds the extension: a float model on a fresh machine does not wait for a compiler. Otherwise,
and on every other device, the torch reference runs. The two agree to float32 round-off
(tests/kernels/test_cpu_elementwise.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rebar.kernels.cpu_quant.build import loaded_extension


def _compiled_for(*tensors: torch.Tensor):
    if any(t.dtype != torch.float32 or t.device.type != "cpu" or t.requires_grad for t in tensors):
        return None
    return loaded_extension()


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, a new tensor."""
    extension = _compiled_for(gate, up)
    if extension is None:
        return F.silu(gate) * up
    return extension.silu_and_mul(gate, up)


def reference_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ([num_tokens, num_heads, head_dim]) rotated by its positions' angles in torch, on any
    device: the half-split layout (HF's `rotate_half`), cos and sin [num_tokens, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ([num_tokens, num_heads, head_dim]) rotated by its positions' angles; a contiguous x is
    rotated in place (the caller's projection output, used only here)."""
    extension = _compiled_for(x, cos, sin)
    if extension is None or not (x.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()):
        return reference_rope(x, cos, sin)
    extension.rope_(x, cos, sin)
    return x

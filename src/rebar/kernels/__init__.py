"""Attention and linear backends: torch reference, the CPU fast path (C++), Triton for GPUs."""

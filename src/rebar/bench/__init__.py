"""Benchmarks: offline engine, HTTP serving, comparisons with llama.cpp, the performance gate."""

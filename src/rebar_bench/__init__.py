"""rebar's tooling, installed beside the service and never imported by it: benchmarks of the
offline engine and HTTP serving, comparisons with llama.cpp (its build driver), the performance
gate; `rebar bench ...` finds it by entry point."""

"""Weight quantization: int8/int4 and GGUF block formats, AWQ, calibration data, rebar's quantized
checkpoints."""

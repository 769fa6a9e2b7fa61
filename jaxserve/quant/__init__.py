"""Quantized weights: schemes (scheme.py), their declaration as qwix QArrays (layout.py) and host-side
quantization while loading (host.py). Model code multiplies through jaxserve/model/matmul.py."""

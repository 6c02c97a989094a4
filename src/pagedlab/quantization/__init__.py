"""Quantized weight formats: how their tensors are laid out, read from a checkpoint's config,
dequantized, and cut into tensor-parallel shards."""

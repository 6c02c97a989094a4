"""Attention kernels over the paged KV cache: each Triton kernel sits next to its torch reference."""

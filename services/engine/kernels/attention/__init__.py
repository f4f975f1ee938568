"""Attention kernels over the paged pool, read in place: flash-decoding of one token per sequence (fp16 dots, and
fp8 rows on fp8 tensor cores), causal prefill of a prompt chunk, and the K/V row loads and online-softmax tile
step they share (attention_tiles).
"""

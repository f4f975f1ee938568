"""Attention kernels over the paged pool, read in place: flash-decoding of one token per sequence (fp8 rows with
fp16 dots), causal prefill of a prompt chunk, and the K/V row loads and online-softmax tile
step they share (attention_tiles).
"""

"""A decoder layer's and a step's compute kernels and their launch helpers: decode-sized projections (linear_triton),
fused norms and RoPE (norm_triton), the persistent layer-half launch (block_triton), the vocabulary head with its
argmax (head_triton), the end of a captured decode step (step_triton), the gated delta rule of linear-attention
layers (gated_delta), and the arrival counters of split and persistent launches (arrivals).
"""

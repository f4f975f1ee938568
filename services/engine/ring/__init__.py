"""The KVMem ring: which pages a long sequence keeps resident (buckets), how they are scored and picked (summaries,
ring), attention over pages that arrive in parts (exact_attention), the sliding-window layers' small rings
(local_ring), and the host store as the ring sees it (host_pages).
"""

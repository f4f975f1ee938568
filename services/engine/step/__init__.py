"""The step loop's parts: the scheduler, the model runner and its CUDA-graph decode, sampling with grammar masks,
sequences and their detokenizers.
"""

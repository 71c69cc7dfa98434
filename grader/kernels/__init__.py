"""Graders of the kernels family: Triton kernels (GeLU, row sums, softmax, RMSNorm, matmul) and attention (in PyTorch
and in Triton). One test module per problem; attention_cases, dtype_cases and speed_cases are what several use."""

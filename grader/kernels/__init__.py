"""Graders of the kernels family: Triton kernels (softmax, GeLU, row sums, matmul, RMSNorm) and attention (in
PyTorch and in Triton). One test module per problem; attention_cases and speed_cases are what several use."""

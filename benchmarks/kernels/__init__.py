"""Single kernels and layer ops on CPU: the quantized matmuls and the fused layer ops."""

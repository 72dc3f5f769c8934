"""The model on the device: flat inputs from a scheduled batch, kernels (ops), CUDA graphs, the CPU
engine's oneDNN linears and allocator, warm-up, the encoder runner."""

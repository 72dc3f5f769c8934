"""The CPU engine's kernels: the native C++ library built from ../csrc, and the attention, prefill, prefix,
chunk and pointwise kernels on it."""

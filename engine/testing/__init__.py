"""Tiny random-weight model directories (decoders, MoE, embedders, encoders) for tests, examples and
benchmarks."""

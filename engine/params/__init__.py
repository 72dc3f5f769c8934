"""Torch-free request and result types in vLLM's shapes: SamplingParams, PoolingParams, structured-
output params, RequestOutput and the pooling/scoring outputs."""

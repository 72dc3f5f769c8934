"""Prefill/decode disaggregation: the worker roles, KV transport (in-process and over ZeroMQ), the
prefill registry, service and client."""

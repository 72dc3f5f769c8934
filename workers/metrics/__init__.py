"""A worker's Prometheus series, their endpoint behind the metrics token, and the prefill/decode
split's series."""

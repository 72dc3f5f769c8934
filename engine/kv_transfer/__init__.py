"""A prompt's KV out of one engine and into another (prefill/decode disaggregation), and its wire
format."""

"""Beam search: vLLM's beam arithmetic, and beams run as live sequences on the paged cache."""

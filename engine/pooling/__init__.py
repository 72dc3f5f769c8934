"""Pooling (embedding, classify, score) requests: pooled state per sequence, the lean CPU forward,
sentence-transformers Dense, which runner a model gets."""

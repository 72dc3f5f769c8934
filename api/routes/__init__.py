"""Blueprints: the native jobs API, the OpenAI Batch-compatible API, and meta routes."""

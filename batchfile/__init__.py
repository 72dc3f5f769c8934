"""The OpenAI batch line format: read lines, validate a request, render and tokenize prompts, build response bodies."""

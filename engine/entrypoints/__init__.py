"""vLLM's offline `LLM` class and what it needs: constructor arguments, chat options,
embed/classify/score, get_metrics."""

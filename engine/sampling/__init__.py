"""Logits to tokens: the sampler, per-request logit masks, structured-output grammars, prompt logprobs."""

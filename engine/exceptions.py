"""vLLM's `vllm.exceptions`: the error its offline API raises for arguments that cannot be served (a
ValueError, so `except ValueError` keeps working)."""


class VLLMValidationError(ValueError):
    pass

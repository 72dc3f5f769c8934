"""The step loop: requests in (LLMEngine), the scheduler, the paged KV block manager, sequences and
when they stop."""

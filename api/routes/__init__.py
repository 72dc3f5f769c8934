"""Blueprints: the native jobs API (`jobs`), the OpenAI Batch-compatible API (`openai_batch`) and meta
routes (`meta`); what they share: `params` (checked parameters), `uploads` (uploads held to the limits),
`responses` (JSON objects, cached finished jobs, streamed files)."""

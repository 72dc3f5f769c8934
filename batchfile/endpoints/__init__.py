"""Per-endpoint and per-feature request readers and output bodies: chat/completion responses, /v1/responses,
embeddings, score/rerank, tool calls, completion options, structured output."""

"""The OpenAI batch line format, with no database, web server or broker.

- `request`: the endpoints and `ParsedRequest`, a validated line ready for the engine
- `errors`: the per-line error codes, `LineError`, `InputTooLarge`
- `lines`: reading an input line by line under size limits; `count_lines`
- `model_limits`: `ModelLimits`, what validation needs from a model (tokenizer, context, vocabulary)
- `fields`, `sampling`: checks of body values; the body's generation fields as `SamplingParams`
- `validation`: one line's checks; `prompts`: batched chat rendering and tokenization
- `parser`: `parse_requests`, the pipeline over a whole input
- `shard_input`: the shard-input line the workers run, and `validate_stream` for uploads
- `responses`: OpenAI's completion bodies and the batch output/error lines
"""

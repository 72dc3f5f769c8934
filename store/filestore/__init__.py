"""Where files live: the storage backends (local or fsspec URL), their fault classification, retries, waits
and health, the file records and the key paths."""

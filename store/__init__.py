"""The job core that the API and the workers share: no web server, broker or engine in here.

- `models`, `db`, `settings`, `ids`: the tables, sessions, PAGEDBATCH_* settings, public ids
- `errors`: StoreError and its kinds, each with the HTTP status the API answers with
- `files`: uploads and produced files; `storage`: where files live, atomic writes; `paths`: their keys
- `jobs`: create (inserted `validating`), read, list; `validating`: the input validated in the background,
  streamed into shards handed to an `enqueue` callable, resumable
- `progress`: a job's live counts; `pagination`: newest-first pages
- `cancel`: cancel and expire; `shards`: the workers' leases; `finalize`: a finished job's files and counts
- `results`: Parquet results (rows, parts, merge, OpenAI JSONL)
- `keys`: API keys and tenants; `limits`: per-tenant limits checked when a job is created
"""

"""The job core: database models, files, jobs, shards and leases, finalize, Parquet results, storage, tenants."""

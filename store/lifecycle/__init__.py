"""A job's life: created, validated in the background, its shards leased and written, its progress,
cancelled or expired, finalized."""

"""The Redis/Celery wire shared by the API and the workers: queue names, sending shard tasks by name, queue depth."""

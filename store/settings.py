"""Platform settings, read from PAGEDBATCH_* environment variables."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from batchfile.sampling import OPENAI_MAX_STOP_STRINGS, RequestBounds


def home_dir() -> Path:
    """The local data directory: $PAGEDBATCH_HOME, else ~/.pagedbatch (read at each call)."""
    return Path(os.environ.get("PAGEDBATCH_HOME") or "~/.pagedbatch").expanduser()


def parse_models(spec: str | list[str] | None) -> dict[str, str]:
    """`NAME=PATH` items (a list, or one comma-separated string) as {name: path}.

    A bare PATH is named after its last directory component.
    """
    if not spec:
        return {}
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    models: dict[str, str] = {}
    for item in (i.strip() for i in items):
        if not item:
            continue
        name, sep, path = item.partition("=")
        if not sep:
            name, path = Path(item).name, item
        if not name or not path:
            raise ValueError(f"bad model spec {item!r}; expected NAME=PATH")
        models[name] = path
    return models


def format_models(models: dict[str, str]) -> str:
    return ",".join(f"{name}={path}" for name, path in models.items())


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


@dataclass
class Settings:
    database_url: str = ""
    broker_url: str = ""
    storage_url: str = ""
    models: dict[str, str] = field(default_factory=dict)  # model name -> path, for validation
    # models whose chat content may hold real special tokens (by default such text is plain text)
    special_tokens_in_content: list[str] = field(default_factory=list)
    max_upload_bytes: int = 200 * 1024 * 1024
    max_lines: int = 50_000
    shard_size: int = 256
    broker_prefix: str = ""  # a Redis key prefix, so several deployments can share one Redis db
    queue_prefix: str = "pagedbatch"
    cancel_poll_s: float = 0.25
    default_tenant: str = "default"  # the tenant of `serve`'s local key and of `keys create` without --tenant
    # per-tenant limits (a tenant's row in the tenants table may override them); 0 means unlimited
    max_active_jobs_per_tenant: int = 100
    max_queued_requests_per_tenant: int = 1_000_000
    max_files_per_tenant: int = 10_000  # uploaded files a tenant keeps at once (DELETE frees them)
    max_file_bytes_per_tenant: int = 100 * 1024**3  # their bytes together
    limit_retry_after_s: int = 30  # the Retry-After of a 429
    # what one request line may ask for (batchfile.sampling.RequestBounds); /v1/batches keeps OpenAI's 4 stops
    max_stop_strings: int = 16
    max_stop_chars: int = 1000
    max_request_output_tokens: int = 1 << 18  # n x max_tokens x (1 + logprobs per token)
    max_concurrent_validations: int = 2  # jobs validated at once per API process (in the background)
    key_cache_s: float = 5.0  # how long a checked API key is trusted before the database is asked again
    # a job waiting on storage (full, unreachable) is retried with backoff up to this many seconds apart,
    # and fails (storage_full / storage_unavailable) once it has waited `storage_give_up_s`
    storage_retry_max_s: float = 15.0
    storage_give_up_s: float = 24 * 3600.0
    storage_min_free_bytes: int = 512 * 1024**2  # local storage with less free is reported degraded

    @classmethod
    def from_env(cls, **overrides) -> Settings:
        env = os.environ
        settings = cls(
            database_url=env.get("PAGEDBATCH_DATABASE_URL", ""),
            broker_url=env.get("PAGEDBATCH_BROKER_URL", ""),
            storage_url=env.get("PAGEDBATCH_STORAGE_URL", str(home_dir() / "storage")),
            models=parse_models(env.get("PAGEDBATCH_MODELS", "")),
            special_tokens_in_content=[
                m for m in env.get("PAGEDBATCH_SPECIAL_TOKENS_IN_CONTENT", "").split(",") if m.strip()
            ],
            max_upload_bytes=_env_int("PAGEDBATCH_MAX_UPLOAD_BYTES", 200 * 1024 * 1024),
            max_lines=_env_int("PAGEDBATCH_MAX_LINES", 50_000),
            shard_size=_env_int("PAGEDBATCH_SHARD_SIZE", 256),
            broker_prefix=env.get("PAGEDBATCH_BROKER_PREFIX", ""),
            queue_prefix=env.get("PAGEDBATCH_QUEUE_PREFIX", "pagedbatch"),
            cancel_poll_s=float(env.get("PAGEDBATCH_CANCEL_POLL_S", "0.25")),
            max_active_jobs_per_tenant=_env_int("PAGEDBATCH_MAX_ACTIVE_JOBS_PER_TENANT", 100),
            max_queued_requests_per_tenant=_env_int("PAGEDBATCH_MAX_QUEUED_REQUESTS_PER_TENANT", 1_000_000),
            max_files_per_tenant=_env_int("PAGEDBATCH_MAX_FILES_PER_TENANT", 10_000),
            max_file_bytes_per_tenant=_env_int("PAGEDBATCH_MAX_FILE_BYTES_PER_TENANT", 100 * 1024**3),
            limit_retry_after_s=_env_int("PAGEDBATCH_LIMIT_RETRY_AFTER_S", 30),
            max_stop_strings=_env_int("PAGEDBATCH_MAX_STOP_STRINGS", 16),
            max_stop_chars=_env_int("PAGEDBATCH_MAX_STOP_CHARS", 1000),
            max_request_output_tokens=_env_int("PAGEDBATCH_MAX_REQUEST_OUTPUT_TOKENS", 1 << 18),
            max_concurrent_validations=_env_int("PAGEDBATCH_MAX_CONCURRENT_VALIDATIONS", 2),
            key_cache_s=float(env.get("PAGEDBATCH_KEY_CACHE_S", "5")),
            storage_retry_max_s=float(env.get("PAGEDBATCH_STORAGE_RETRY_MAX_S", "15")),
            storage_give_up_s=float(env.get("PAGEDBATCH_STORAGE_GIVE_UP_S", str(24 * 3600))),
            storage_min_free_bytes=_env_int("PAGEDBATCH_STORAGE_MIN_FREE_BYTES", 512 * 1024**2),
        )
        for key, value in overrides.items():
            if value is not None:
                setattr(settings, key, value)
        return settings

    def to_env(self) -> dict[str, str]:
        """The environment variables that reproduce these settings in another process."""
        return {
            "PAGEDBATCH_DATABASE_URL": self.database_url,
            "PAGEDBATCH_BROKER_URL": self.broker_url,
            "PAGEDBATCH_STORAGE_URL": self.storage_url,
            "PAGEDBATCH_MODELS": format_models(self.models),
            "PAGEDBATCH_SPECIAL_TOKENS_IN_CONTENT": ",".join(self.special_tokens_in_content),
            "PAGEDBATCH_MAX_UPLOAD_BYTES": str(self.max_upload_bytes),
            "PAGEDBATCH_MAX_LINES": str(self.max_lines),
            "PAGEDBATCH_SHARD_SIZE": str(self.shard_size),
            "PAGEDBATCH_BROKER_PREFIX": self.broker_prefix,
            "PAGEDBATCH_QUEUE_PREFIX": self.queue_prefix,
            "PAGEDBATCH_CANCEL_POLL_S": str(self.cancel_poll_s),
            "PAGEDBATCH_MAX_ACTIVE_JOBS_PER_TENANT": str(self.max_active_jobs_per_tenant),
            "PAGEDBATCH_MAX_QUEUED_REQUESTS_PER_TENANT": str(self.max_queued_requests_per_tenant),
            "PAGEDBATCH_MAX_FILES_PER_TENANT": str(self.max_files_per_tenant),
            "PAGEDBATCH_MAX_FILE_BYTES_PER_TENANT": str(self.max_file_bytes_per_tenant),
            "PAGEDBATCH_LIMIT_RETRY_AFTER_S": str(self.limit_retry_after_s),
            "PAGEDBATCH_MAX_STOP_STRINGS": str(self.max_stop_strings),
            "PAGEDBATCH_MAX_STOP_CHARS": str(self.max_stop_chars),
            "PAGEDBATCH_MAX_REQUEST_OUTPUT_TOKENS": str(self.max_request_output_tokens),
            "PAGEDBATCH_MAX_CONCURRENT_VALIDATIONS": str(self.max_concurrent_validations),
            "PAGEDBATCH_KEY_CACHE_S": str(self.key_cache_s),
            "PAGEDBATCH_STORAGE_RETRY_MAX_S": str(self.storage_retry_max_s),
            "PAGEDBATCH_STORAGE_GIVE_UP_S": str(self.storage_give_up_s),
            "PAGEDBATCH_STORAGE_MIN_FREE_BYTES": str(self.storage_min_free_bytes),
        }

    def request_bounds(self, *, openai: bool) -> RequestBounds:
        """What one request may ask for; the OpenAI face keeps OpenAI's 4 stop strings at most."""
        stops = min(self.max_stop_strings, OPENAI_MAX_STOP_STRINGS) if openai else self.max_stop_strings
        return RequestBounds(stops, self.max_stop_chars, self.max_request_output_tokens)

    def queue_for(self, model: str) -> str:
        return f"{self.queue_prefix}.{model}"

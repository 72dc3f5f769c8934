"""Platform settings: PAGEDBATCH_* environment variables as read by `settings.PlatformSettings`, and
what a process passes on to the processes it starts (`to_env`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from batchfile.sampling import OPENAI_MAX_STOP_STRINGS, RequestBounds
from settings import PlatformSettings, current


def home_dir() -> Path:
    """The local data directory: $PAGEDBATCH_HOME, else ~/.pagedbatch (read at each call)."""
    return Path(current(PlatformSettings).home).expanduser()


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
    plan_prefixes: bool = True  # lines sharing a prompt prefix grouped into shards (batchfile.prefix_plan)
    plan_block_size: int = 16  # the workers' KV block size
    plan_window_lines: int = 8192  # valid lines planned together before their shards are written
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
    # uploads in parts (OpenAI's Uploads API): the whole file is held to max_upload_bytes and max_lines
    max_upload_part_bytes: int = 64 * 1024**2
    max_upload_parts: int = 10_000
    upload_expires_s: int = 3600  # an upload not completed by then is gone, its parts deleted
    # webhooks: endpoints on loopback or private addresses are refused unless allowed (`serve` allows loopback)
    webhook_allow_loopback: bool = False
    webhook_allow_private: bool = False
    webhook_max_attempts: int = 8  # a delivery not answered 2xx after this many attempts is marked failed
    webhook_retry_base_s: float = 5.0  # the wait before the second attempt, doubled after each failure
    webhook_timeout_s: float = 10.0
    webhook_poll_s: float = 1.0  # how often each worker's webhook sender looks for due deliveries
    webhook_concurrency: int = 8  # attempts in flight at once per worker: a slow endpoint cannot hold up the rest

    @classmethod
    def from_env(cls, **overrides) -> Settings:
        """The environment's settings (`settings.PlatformSettings`: typed, a bad value is a clear error);
        `overrides` that are not None win."""
        env = current(PlatformSettings)
        plain = {f.name for f in fields(cls)} & set(PlatformSettings.model_fields)
        plain -= {"models", "special_tokens_in_content", "storage_url"}
        settings = cls(
            **{name: getattr(env, name) for name in plain},
            storage_url=env.storage_url or str(home_dir() / "storage"),
            models=parse_models(env.models),
            special_tokens_in_content=[m for m in env.special_tokens_in_content.split(",") if m.strip()],
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
            "PAGEDBATCH_PLAN_PREFIXES": "1" if self.plan_prefixes else "0",
            "PAGEDBATCH_PLAN_BLOCK_SIZE": str(self.plan_block_size),
            "PAGEDBATCH_PLAN_WINDOW_LINES": str(self.plan_window_lines),
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
            "PAGEDBATCH_MAX_UPLOAD_PART_BYTES": str(self.max_upload_part_bytes),
            "PAGEDBATCH_MAX_UPLOAD_PARTS": str(self.max_upload_parts),
            "PAGEDBATCH_UPLOAD_EXPIRES_S": str(self.upload_expires_s),
            "PAGEDBATCH_WEBHOOK_ALLOW_LOOPBACK": "1" if self.webhook_allow_loopback else "0",
            "PAGEDBATCH_WEBHOOK_ALLOW_PRIVATE": "1" if self.webhook_allow_private else "0",
            "PAGEDBATCH_WEBHOOK_MAX_ATTEMPTS": str(self.webhook_max_attempts),
            "PAGEDBATCH_WEBHOOK_RETRY_BASE_S": str(self.webhook_retry_base_s),
            "PAGEDBATCH_WEBHOOK_TIMEOUT_S": str(self.webhook_timeout_s),
            "PAGEDBATCH_WEBHOOK_POLL_S": str(self.webhook_poll_s),
            "PAGEDBATCH_WEBHOOK_CONCURRENCY": str(self.webhook_concurrency),
        }

    def request_bounds(self, *, openai: bool) -> RequestBounds:
        """What one request may ask for; the OpenAI face keeps OpenAI's 4 stop strings at most."""
        stops = min(self.max_stop_strings, OPENAI_MAX_STOP_STRINGS) if openai else self.max_stop_strings
        return RequestBounds(stops, self.max_stop_chars, self.max_request_output_tokens)

    def queue_for(self, model: str) -> str:
        return f"{self.queue_prefix}.{model}"

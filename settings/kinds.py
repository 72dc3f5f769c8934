"""The settings classes, one per process kind; each field's description is its line in
docs/configuration.md. Defaults are the values a process runs with when the variable is unset."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from settings.base import EnvSettings

MiB = 1024**2


class PlatformSettings(EnvSettings):
    """Shared by the API, the workers and the command line (`store.settings.Settings` reads it)."""

    home: str = Field("~/.pagedbatch", description="local data: `serve`'s embedded services, saved tracebacks")
    database_url: str = Field("", description="PostgreSQL URL (embedded under `serve` when unset)")
    broker_url: str = Field("", description="Redis URL (embedded under `serve` when unset)")
    storage_url: str = Field(
        "", description="inputs, parts, results: a directory or fsspec URL (default: `$PAGEDBATCH_HOME/storage`)"
    )
    models: str = Field("", description="`name=path,...`: the models the API validates against")
    special_tokens_in_content: str = Field(
        "", description="comma-separated models whose chat content may hold real special tokens (plain text otherwise)"
    )
    max_upload_bytes: int = Field(200 * MiB, ge=1, description="an upload above this is answered 413")
    max_lines: int = Field(50_000, ge=1, description="a batch file with more lines is answered 413")
    shard_size: int = Field(256, ge=1, description="requests per shard (per Celery task)")
    plan_prefixes: bool = Field(True, description="group lines sharing a prompt prefix into shards (else file order)")
    plan_block_size: int = Field(16, ge=1, description="the workers' KV block size: the granularity of prefix plans")
    plan_window_lines: int = Field(
        8192,
        ge=1,
        description="valid lines planned together (before shards are written; at most a shard: file order); "
        "a file's first windows are smaller (4 shards, then doubling), so that work starts at once",
    )
    broker_prefix: str = Field("", description="Redis key prefix, so several deployments can share one Redis db")
    queue_prefix: str = Field("pagedbatch", description="queue name prefix (`<prefix>.<model>`)")
    cancel_poll_s: float = Field(0.25, gt=0, description="how often workers look for cancelled jobs")
    max_active_jobs_per_tenant: int = Field(100, ge=0, description="per-tenant limit (0: unlimited)")
    max_queued_requests_per_tenant: int = Field(1_000_000, ge=0, description="per-tenant limit (0: unlimited)")
    max_files_per_tenant: int = Field(10_000, ge=0, description="uploaded files a tenant keeps at once (0: unlimited)")
    max_file_bytes_per_tenant: int = Field(100 * 1024**3, ge=0, description="their bytes together (0: unlimited)")
    limit_retry_after_s: int = Field(30, ge=0, description="the Retry-After of a 429")
    max_stop_strings: int = Field(16, ge=0, description="stop strings per request (/v1/batches keeps OpenAI's 4)")
    max_stop_chars: int = Field(1000, ge=0, description="characters per stop string")
    max_request_output_tokens: int = Field(1 << 18, ge=1, description="n x max_tokens x (1 + logprobs per token)")
    max_concurrent_validations: int = Field(2, ge=1, description="jobs validated at once per API process")
    key_cache_s: float = Field(
        5.0, ge=0, description="how long a checked API key is trusted before the database is asked again"
    )
    storage_retry_max_s: float = Field(
        15.0, gt=0, description="a job waiting on storage is retried at most this far apart (backoff, jitter)"
    )
    storage_give_up_s: float = Field(
        24 * 3600.0, gt=0, description="a job waiting on storage fails after waiting this long"
    )
    storage_min_free_bytes: int = Field(
        512 * MiB, ge=0, description="`/readyz` reports local storage with less free space `degraded`"
    )
    max_upload_part_bytes: int = Field(64 * MiB, ge=1, description="the most one part of an upload in parts holds")
    max_upload_parts: int = Field(10_000, ge=1, description="parts of one upload in parts")
    upload_expires_s: int = Field(
        3600, ge=1, description="an upload in parts not completed by then expires (its parts deleted)"
    )
    webhook_allow_loopback: bool = Field(
        False, description="webhook endpoints may be on loopback addresses (`serve` sets it unless given)"
    )
    webhook_allow_private: bool = Field(False, description="webhook endpoints may be on private addresses")
    webhook_max_attempts: int = Field(
        8, ge=1, description="a webhook delivery not answered 2xx after this many attempts is failed"
    )
    webhook_retry_base_s: float = Field(
        5.0, gt=0, description="the wait before a delivery's second attempt, doubled after each failure"
    )
    webhook_timeout_s: float = Field(10.0, gt=0, description="how long one webhook attempt waits for an answer")
    webhook_poll_s: float = Field(1.0, gt=0, description="how often each worker sends due webhook deliveries")
    webhook_concurrency: int = Field(
        8, ge=1, description="webhook attempts each worker has in flight at once (a slow endpoint holds one)"
    )
    heartbeat_s: float = Field(
        10.0, gt=0, description="how often workers renew their registry heartbeat (stale after 3)"
    )
    visibility_timeout_s: float = Field(
        6 * 3600.0, gt=0, description="Redis redelivers a task not acknowledged for this long"
    )
    log_format: str = Field("text", description="`json` or `text` log lines (API and workers)")
    metrics_token: str = Field(
        "", description="when set, `/metrics` and workers' metrics ports need `Authorization: Bearer <token>`"
    )


class ApiSettings(EnvSettings):
    """The API process (`pagedbatch api`, `serve`'s API)."""

    secret_key: str = Field(
        "", description="signs the `/ui` session cookie (same on every API host; random per process when unset)"
    )
    admin_tenants: str = Field("admin", description="comma-separated tenants whose keys open the `/ui` admin view")
    ui_secure_cookie: bool = Field(False, description="`Secure` session cookie (behind HTTPS)")
    ui_session_hours: int = Field(12, ge=1, description="how long a `/ui` session lasts")
    prometheus_multiproc_dir: str = Field(
        "",
        validation_alias="PROMETHEUS_MULTIPROC_DIR",
        description="prometheus_client's directory shared by the gunicorn workers (`pagedbatch api` sets it)",
    )


class WorkerSettings(EnvSettings):
    """The worker process (`pagedbatch worker`, `serve`'s workers)."""

    worker_drain_s: float = Field(
        0.0,
        ge=0,
        description="default of `worker --drain-timeout`: how long a warm shutdown lets running requests finish",
    )
    lease_s: float = Field(60.0, ge=0, description="a running shard not renewed for this long is taken back")
    sweep_s: float = Field(10.0, ge=0, description="time between recovery sweeps (with jitter)")
    requeue_s: float = Field(60.0, ge=0, description="how often a queued shard's broker message is checked")
    max_shard_attempts: int = Field(5, ge=0, description="claims of one shard before its requests fail (0: no limit)")
    engine_process: bool = Field(
        False,
        description="run the worker's engine in a process of its own (its loop never waits on the shard threads' "
        "interpreter lock)",
    )
    fair_share: bool = Field(True, description="share a worker's engine fairly between tenants")
    fair_reserve: int | None = Field(
        None,
        ge=0,
        description="engine slots kept for other tenants, lent to a tenant alone (default: a sixteenth, at least 1)",
    )
    fair_slice: float = Field(1.0, ge=0, description="a tenant's time slice, relative")
    fair_burst_s: float = Field(0.5, ge=0, description="at most this much of a tenant's share saved up")
    fair_step_factor: float = Field(
        4.0, ge=0, description="a big tenant's steps last about this many fixed costs per step (0: off)"
    )
    kv_host: str = Field("127.0.0.1", description="the address other hosts reach this worker's KV sockets at")
    kv_max_send_mbps: float = Field(0.0, ge=0, description="caps a prefill worker's KV send rate (0: no cap)")
    kv_timeout_s: float = Field(120.0, gt=0, description="a remote prefill that stalls this long is done locally")
    prefill_in_flight: int = Field(8, ge=1, description="remote prefills a decode worker has in flight at most")
    prefill_liveness_s: float = Field(3.0, gt=0, description="a prefill worker whose heartbeat is older is dead")


class ClientSettings(EnvSettings):
    """The command line's client commands (`submit`, `jobs`, `status`, ...)."""

    api_url: str = Field("http://127.0.0.1:8000", description="the server the client commands talk to")
    api_key: str = Field("", description="the key the client commands send (else the one `serve` saved)")
    debug: bool = Field(False, description="print tracebacks instead of one line per failure (like `--debug`)")


class EngineSettings(EnvSettings):
    """The engine and its CPU kernels, in whatever process runs a model."""

    cpu_native: Literal["on", "off"] = Field(
        "on", description="`off` keeps torch's CPU attention instead of the native kernels"
    )
    cpu_prefix: Literal["native", "batched", "flash"] | None = Field(
        None, description="fixes the CPU prefix-attention kernel (else the fastest, timed once per shape)"
    )
    cpu_prefill: Literal["native", "sdpa", "matmul"] | None = Field(
        None, description="fixes the CPU prefill-attention kernel (else the fastest, timed once per shape)"
    )
    cpu_malloc: Literal["keep", "default"] = Field(
        "keep", description="`default` leaves glibc's allocator settings alone"
    )
    cpu_threads: Literal["auto", "all"] = Field(
        "all",
        description="`all` runs every CPU step on all intra-op threads (but a small one, of under 2**26 "
        "multiply-adds, on one, whatever the load); `auto` also drops to one while the host does not give "
        "them their cores, for hosts shared with other work (engine/runner/cpu_threads.py; float results "
        "may then differ in the last bits between runs)",
    )
    moe_path: Literal["auto", "grouped"] = Field(
        "auto", description="`grouped` turns off the CPU's padded batched-matmul and native paths for MoE experts"
    )
    moe_threads: Literal["one", "all"] = Field(
        "one", description="`all` keeps every intra-op thread for the experts' small matmuls"
    )
    cxx: str = Field(
        "", validation_alias="CXX", description="the C++ compiler for the native kernels (else c++, g++ or clang++)"
    )
    xdg_cache_home: str = Field(
        "",
        validation_alias="XDG_CACHE_HOME",
        description="the native kernels are built under `<this>/pagedbatch/native` (default `~/.cache`)",
    )
    triton_interpret: bool = Field(
        False,
        validation_alias="TRITON_INTERPRET",
        description="Triton's interpreter: kernels run on CPU tensors (the tests set it without a GPU)",
    )
    startup: Literal["full", "quick", "deferred"] = Field(
        "full",
        description="CPU kernels at start: `full` compiles and times them before the first step, `quick` "
        "runs eagerly, `deferred` (a worker's default) starts quick and compiles when idle",
    )
    torchinductor_cache_dir: str = Field(
        "",
        validation_alias="TORCHINDUCTOR_CACHE_DIR",
        description="inductor's compiled code (default `<XDG_CACHE_HOME>/pagedbatch/inductor-<torch version>`)",
    )
    image_max_bytes: int = Field(20 << 20, gt=0, description="an image's largest encoded size (data URL or fetched)")
    image_max_pixels: int = Field(40_000_000, gt=0, description="an image's largest width x height")
    max_images_per_line: int = Field(16, gt=0, description="images one batch line may carry")
    pythonpath: str = Field(
        "",
        validation_alias="PYTHONPATH",
        description="kept on the path of the detached process that builds the native kernels",
    )
    image_fetch_allow: str = Field(
        "",
        description="comma-separated networks (CIDR) an http(s) image URL may reach despite the private/loopback guard",
    )
    tp_timeout_s: float = Field(
        300.0,
        gt=0,
        description="tensor parallelism: a collective that waits longer than this ends the engine (a rank is stuck)",
    )
    master_addr: str = Field(
        "",
        validation_alias="MASTER_ADDR",
        description="tensor parallelism across hosts: rank 0's address (torch.distributed)",
    )
    master_port: int | None = Field(None, validation_alias="MASTER_PORT", description="rank 0's port, with MASTER_ADDR")
    world_size: int | None = Field(
        None,
        validation_alias="WORLD_SIZE",
        ge=1,
        description="the ranks of the group this process joins (= tensor_parallel_size)",
    )
    rank: int | None = Field(None, validation_alias="RANK", ge=0, description="this process's rank in that group")
    local_rank: int | None = Field(
        None,
        validation_alias="LOCAL_RANK",
        ge=0,
        description="this rank's GPU on its host (else RANK modulo the GPU count)",
    )

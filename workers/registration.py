"""A worker's entry in the models registry (`store.models_registry`): registered when the engine is loaded,
renewed by a heartbeat thread, removed at shutdown. A worker that dies stops beating and drops out of
`/v1/models` within three heartbeat intervals."""

from __future__ import annotations

import logging
import os
import socket
import threading
from pathlib import Path

from engine.hf.encoder_config import ENCODER_ARCHITECTURES, EncoderConfig, encoder_architecture
from engine.hf.model_info import context_length, read_config
from engine.hf.sentence_transformers_config import default_runner
from store import models_registry
from store.models_registry import Registration
from store.settings import Settings

log = logging.getLogger(__name__)

GENERATE_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
POOLING_ENDPOINTS = ("/v1/embeddings", "/v1/score", "/v1/rerank")
CLASSIFIER_ENDPOINTS = ("/v1/score", "/v1/rerank")


def endpoints_of(model_path: str, config: dict) -> tuple[str, ...]:
    """The batch URLs a model directory serves: embeddings, score and rerank for an embedding model,
    score and rerank for a cross-encoder, generation otherwise."""
    if default_runner(Path(model_path), config) != "pooling":
        return GENERATE_ENDPOINTS
    arch = encoder_architecture(config)
    return CLASSIFIER_ENDPOINTS if arch and ENCODER_ARCHITECTURES[arch][1] else POOLING_ENDPOINTS


def registration_for(
    model_name: str,
    model_path: str,
    *,
    max_model_len: int | None,
    metrics_port: int | None,
    adapters: dict[str, str] | None = None,
) -> Registration:
    """This process's registration: its Celery-style name, the model's path and context length, its LoRA
    adapters."""
    hostname = socket.gethostname()
    config = read_config(model_path)
    if encoder_architecture(config):  # RoBERTa's positions start past the padding id
        length = EncoderConfig.from_dict(config, Path(model_path), max_model_len).max_model_len
    else:
        length = context_length(config, max_model_len)
    return Registration(
        worker=f"{model_name}-{os.getpid()}@{hostname}",
        model=model_name,
        path=os.path.abspath(model_path),
        endpoints=endpoints_of(model_path, config),
        max_model_len=length,
        hostname=hostname,
        pid=os.getpid(),
        metrics_port=metrics_port,
        adapters=tuple(sorted((adapters or {}).items())),
    )


class Heartbeat:
    """Registers `registration` now and renews it every `interval_s` until `close`."""

    def __init__(
        self, settings: Settings, registration: Registration, interval_s: float | None = None, throughput=None
    ):
        self.settings = settings
        self.registration = registration
        self.throughput = throughput  # a callable: the measured step rates each beat publishes
        self.interval_s = interval_s or models_registry.heartbeat_s()
        self._stop = threading.Event()
        try:
            models_registry.register(settings, registration)
        except Exception:  # the heartbeat thread registers it once the database answers
            log.warning("could not register %s; will retry", registration.worker, exc_info=True)
        self._thread = threading.Thread(target=self._run, name="registry-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                rates = self.throughput() if self.throughput is not None else None
                if not models_registry.heartbeat(self.settings, self.registration.worker, rates):
                    models_registry.register(self.settings, self.registration)  # someone removed our row
            except Exception:  # the database may be down for a while; keep beating
                log.warning("registry heartbeat failed; retrying in %.0fs", self.interval_s, exc_info=True)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            models_registry.unregister(self.settings, self.registration.worker)
        except Exception:  # its heartbeat goes stale instead
            log.warning("could not unregister %s", self.registration.worker, exc_info=True)

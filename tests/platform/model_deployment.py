"""A deployment of a test's own (database, queues, storage) serving one tiny checkpoint: the fixture
code shared by the platform tests of particular model families."""

from __future__ import annotations

import contextlib
import dataclasses
import secrets

from engine.testing.tiny import write_tiny_model


@contextlib.contextmanager
def model_deployment(platform, tmp_path, model: str, arch: str):
    """(settings, API key, model path) of a fresh deployment serving a tiny `arch` model as `model`."""
    from migrations import upgrade
    from pagedbatch.embedded import create_database, drop_database
    from store.db import get_engine
    from store.keys import create_key

    path = write_tiny_model(tmp_path / model, arch=arch)
    token = secrets.token_hex(4)
    name = f"pagedbatch_{model}_{token}"
    create_database(platform.admin_url, name)
    base, _, query = platform.admin_url.partition("?")
    settings = dataclasses.replace(
        platform.settings,
        database_url=base.rsplit("/", 1)[0] + "/" + name + ("?" + query if query else ""),
        storage_url=str(tmp_path / "storage"),
        models={model: str(path)},
        queue_prefix=f"pb{model}-{token}",
        broker_prefix=f"pb{model}-{token}:",
    )
    upgrade(settings.database_url)
    api_key, _ = create_key(settings, settings.default_tenant, name=model)
    try:
        yield settings, api_key, path
    finally:
        get_engine(settings.database_url).dispose()
        drop_database(platform.admin_url, name)

"""Every environment variable that pagedbatch reads, in one place: one pydantic-settings class per
process kind, typed and checked when the process starts (`check_environment`), and the source of
docs/configuration.md (`python -m settings.docs`).

- `PlatformSettings`: what the API, the workers and the command line share (database, broker, storage,
  models, limits); `store.settings.Settings.from_env` reads it.
- `ApiSettings`: the API process (dashboard sessions, metrics).
- `WorkerSettings`: the worker process (recovery, fair share, prefill/decode roles, drain).
- `ClientSettings`: the command line (where the API is, the key, logs, tracebacks).
- `EngineSettings`: the inference engine and its CPU kernels, in any process that runs a model.
"""

from settings.base import SettingsError, check, child_environment, current, export, is_set, value
from settings.kinds import ApiSettings, ClientSettings, EngineSettings, PlatformSettings, WorkerSettings

KINDS = (PlatformSettings, ApiSettings, WorkerSettings, ClientSettings, EngineSettings)


def check_environment(*kinds: type) -> None:
    """Read every class of `kinds` (all by default) now: a bad value stops the process here, with a
    message that names the variable, instead of failing later on first use."""
    problems = []
    for kind in kinds or KINDS:
        try:
            check(kind)
        except SettingsError as exc:
            problems.append(str(exc))
    if problems:
        raise SettingsError("; ".join(problems))


__all__ = [
    "is_set",
    "KINDS",
    "ApiSettings",
    "ClientSettings",
    "EngineSettings",
    "PlatformSettings",
    "SettingsError",
    "WorkerSettings",
    "check",
    "check_environment",
    "child_environment",
    "current",
    "export",
    "value",
]

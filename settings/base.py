"""The reading itself: the only module outside tests/ and bench/ that touches `os.environ`.

`current(cls)` re-validates a class only when one of its variables changed since the last call (a test's
monkeypatch, a process that exports one); `value(cls, name)` looks at one variable, for hot paths."""

from __future__ import annotations

import os
import threading

from pydantic import ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict


class SettingsError(ValueError):
    """An environment variable holds a value its setting cannot take."""


class EnvSettings(BaseSettings):
    """PAGEDBATCH_<FIELD> for each field unless the field names another variable (its alias);
    an empty variable counts as unset."""

    model_config = SettingsConfigDict(
        env_prefix="PAGEDBATCH_", env_ignore_empty=True, extra="ignore", populate_by_name=True
    )

    @classmethod
    def variables(cls) -> dict[str, str]:
        """field name -> the environment variable it is read from."""
        if cls not in _variables:
            prefix = cls.model_config.get("env_prefix", "")
            _variables[cls] = {
                name: (f.validation_alias if isinstance(f.validation_alias, str) else prefix + name.upper())
                for name, f in cls.model_fields.items()
            }
        return _variables[cls]


_variables: dict[type, dict[str, str]] = {}


_cache: dict[type, tuple[tuple, EnvSettings]] = {}
_lock = threading.Lock()


def check(cls: type[EnvSettings]) -> EnvSettings:
    """A fresh instance read from the environment, or SettingsError naming each bad variable."""
    try:
        return cls()
    except ValidationError as exc:
        names = cls.variables()
        lines = []
        for error in exc.errors():
            field = str(error["loc"][0]) if error["loc"] else ""
            variable = names.get(field, field)
            lines.append(f"{variable}={os.environ.get(variable, '')!r}: {error['msg']}")
        raise SettingsError(f"{cls.__name__}: " + "; ".join(lines)) from None


def current(cls: type[EnvSettings]) -> EnvSettings:
    """`cls` as the environment holds it now, validated again only when one of its variables changed."""
    environ = os.environ
    key = tuple(environ.get(v) for v in cls.variables().values())
    cached = _cache.get(cls)
    if cached is not None and cached[0] == key:
        return cached[1]
    with _lock:
        instance = check(cls)
        _cache[cls] = (key, instance)
    return instance


def value(cls: type[EnvSettings], name: str):
    """One field of `cls` as the environment holds it now: for hot paths (one variable looked at per call,
    the class validated again only when that variable changed)."""
    variable = cls.variables()[name]
    raw = os.environ.get(variable)
    cached = _values.get((cls, name))
    if cached is not None and cached[0] == raw:
        return cached[1]
    result = getattr(current(cls), name)
    _values[(cls, name)] = (raw, result)
    return result


_values: dict[tuple[type, str], tuple[str | None, object]] = {}


def export(name: str, value: str) -> None:
    """Set a variable for this process and the processes it starts (e.g. prometheus_client's directory)."""
    os.environ[name] = value


def is_set(name: str) -> bool:
    """Whether the environment names `name` at all (a default may then be chosen by code)."""
    return name in os.environ


def child_environment(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment with `extra` on top, for a child process."""
    return {**os.environ, **extra}

"""The API imports its broker transport (redis-py for a Redis broker) when the app is made, before
gunicorn forks its workers: not inside the first upload each worker serves, where it cost ~0.1-0.3 s."""

from __future__ import annotations

import subprocess
import sys

PROBE = r"""
import sys
from api.app import create_app
from store.settings import Settings
create_app(Settings(broker_url="redis://127.0.0.1:6379/0"), warm=sys.argv[1] == "warm")
print("redis" in sys.modules, "kombu.transport.redis" in sys.modules)
"""


def _imported(mode: str) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, timeout=120)
    return out.stdout.strip().splitlines()[-1]


def test_the_app_loads_the_redis_transport_before_it_serves():
    assert _imported("warm") == "True True"


def test_an_app_made_cold_leaves_it_to_the_first_connection():
    assert _imported("cold") == "False False"

"""`serve`'s restarter: a process that keeps dying is restarted with a doubling backoff, and says so."""

import subprocess
import sys
import time

from pagedbatch import restarter
from pagedbatch.restarter import Restarter
from tests.helpers import wait_until


def test_a_dying_process_is_restarted_with_a_doubling_backoff(monkeypatch, capsys):
    monkeypatch.setattr(restarter, "MIN_BACKOFF_S", 0.2)
    starts = []

    def start():
        starts.append(time.monotonic())
        return subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])

    keeper = Restarter(poll_s=0.02)
    keeper.add("crasher", start)
    wait_until(lambda: len(starts) >= 4, 30, what="four starts")
    keeper.stop()
    assert len(starts) >= 4
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps[0] >= 0.2 and gaps[1] >= 0.4 and gaps[2] >= 0.8  # 0.2s, 0.4s, 0.8s
    err = capsys.readouterr().err
    assert "crasher (pid" in err and "exited with code 3; restarting it in 0.2s" in err
    assert "restarting it in 0.4s" in err and "crasher restarted (3 restarts so far)" in err


def test_stop_ends_the_processes_and_restarts_nothing(capsys):
    keeper = Restarter(poll_s=0.02)
    keeper.add("sleeper", lambda: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    (proc,) = keeper.processes()
    keeper.stop(timeout=10)
    assert proc.poll() is not None
    time.sleep(0.2)
    assert keeper.processes() == [proc] and "restarted" not in capsys.readouterr().err

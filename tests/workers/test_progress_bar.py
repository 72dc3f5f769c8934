"""The progress bar of `pagedbatch run` and `submit --wait`: requests done, tokens/s and an ETA on a
terminal (a pty here), nothing at all when the output is not one."""

from __future__ import annotations

import fcntl
import io
import os
import struct
import subprocess
import sys
import termios

from workers.progress_bar import RequestBar

DRIVE = r"""
import sys, time
from workers.progress_bar import RequestBar
bar = RequestBar(4, True)
for i in range(3):
    time.sleep(0.3)
    bar.update(1, tokens=50)
bar.set(4, 200, "waiting for a worker")
bar.close()
print("END", file=sys.stderr)
"""


def _run(stderr_is_tty: bool) -> str:
    if not stderr_is_tty:
        done = subprocess.run([sys.executable, "-c", DRIVE], capture_output=True, text=True, timeout=60, check=True)
        return done.stderr
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a terminal's size
    proc = subprocess.Popen([sys.executable, "-c", DRIVE], stderr=slave, stdout=subprocess.DEVNULL)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # the child closed the pty
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=60)
    os.close(master)
    return b"".join(chunks).decode(errors="replace")


def test_a_terminal_shows_requests_tokens_per_second_and_eta():
    out = _run(stderr_is_tty=True)
    assert "3/4 req" in out and "4/4 req" in out
    assert "tok/s" in out and "<" in out  # elapsed<remaining: the ETA
    assert "waiting for a worker" in out and out.rstrip().endswith("END")


def test_no_terminal_no_bar():
    assert _run(stderr_is_tty=False) == "END\n"
    stream = io.StringIO()
    bar = RequestBar(3, True, stream=stream)
    bar.update(3, tokens=9)
    bar.close()
    assert stream.getvalue() == "" and bar.shown is False

"""`stop` returns only once every thread of the process is stopped: a busy thread's counter no longer moves."""

import os
import signal
import subprocess
import sys
import time

from tests.process_stop import group_pids, stop, stop_group

BUSY = """
import sys, threading, time
n = [0]
def spin():
    while True:
        n[0] += 1
for _ in range(3):
    threading.Thread(target=spin, daemon=True).start()
print("ready", flush=True)
while True:
    sys.stdout.write(f"{n[0]}\\n"); sys.stdout.flush(); time.sleep(0.001)
"""


def _start() -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", BUSY], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _drain(fd: int) -> bytes:
    out = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return out
        if not chunk:
            return out
        out += chunk


def _states(pid: int) -> set[str]:
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            stat = f.read()
        out.add(stat[stat.rindex(")") + 2])
    return out


def test_stop_waits_for_every_thread_and_nothing_runs_after():
    proc = _start()
    try:
        stop(proc.pid)
        assert _states(proc.pid) <= {"t", "T"}
        fd = proc.stdout.fileno()
        os.set_blocking(fd, False)
        _drain(fd)  # what it wrote before it stopped
        time.sleep(0.3)
        assert not _drain(fd), "the process wrote after stop() returned"
        os.kill(proc.pid, signal.SIGCONT)
    finally:
        proc.kill()
        proc.wait()


def test_stop_group_stops_the_group_read_from_proc():
    proc = _start()
    try:
        assert group_pids(proc.pid) == [proc.pid]
        stop_group(proc.pid)
        assert _states(proc.pid) <= {"t", "T"}
        os.killpg(proc.pid, signal.SIGCONT)
    finally:
        proc.kill()
        proc.wait()

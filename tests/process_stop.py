"""SIGSTOP that returns only once the process is stopped.

`kill(SIGSTOP)` returns while the signal is still pending: the thread chosen to take it must run before the
group stop reaches the process's other threads, and on a loaded machine another thread (a transport's progress
thread woken by a request) can keep serving meanwhile. Tests that rely on "nothing in it runs now" wait for
every thread of every process to show the stopped state.
"""

import os
import signal
import time


def _threads_stopped(pid: int) -> bool:
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True  # gone: nothing of it runs
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:
            continue  # a thread that exited
        # The state follows the parenthesised command name, which may itself hold spaces or parentheses.
        if stat[stat.rindex(")") + 2] not in "tT":
            return False
    return True


def wait_stopped(pids: list[int], timeout: float = 10.0) -> None:
    """Until every thread of `pids` is stopped; AssertionError naming the ones still running after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        running = [p for p in pids if not _threads_stopped(p)]
        if not running:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"processes {running} not stopped {timeout} s after SIGSTOP")
        time.sleep(0.005)


def stop(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP `pid` and wait until all its threads are stopped."""
    os.kill(pid, signal.SIGSTOP)
    wait_stopped([pid], timeout)


def group_pids(pgid: int) -> list[int]:
    """The processes of process group `pgid`, read from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(stat[stat.rindex(")") + 2:].split()[2]) == pgid:
            out.append(int(entry))
    return out


def stop_group(pgid: int, timeout: float = 10.0) -> None:
    """SIGSTOP process group `pgid` and wait until every thread of its processes is stopped."""
    os.killpg(pgid, signal.SIGSTOP)
    wait_stopped(group_pids(pgid), timeout)

"""One writer per run folder: a second training run pointed at the same --out is refused.

The lock is an advisory flock on `<run folder>/train.lock`. The kernel drops it when the
holding process dies, however it dies (kill -9 included), so a lock file left behind by a
dead run is simply taken over: there is no stale-PID guessing and no race between two
runs that both find the holder dead.
"""

import fcntl
import os
from pathlib import Path

LOCK_NAME = "train.lock"


class RunFolderBusy(OSError):
    """Another live process holds the run folder's lock."""


class RunLock:
    def __init__(self, run_dir):
        self.path = Path(run_dir) / LOCK_NAME
        self.fd = None

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunFolderBusy(
                f"{self.path} is held by another training run (pid {holder}) writing to {self.path.parent}; "
                "wait for it to finish, or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock; the file stays, harmlessly
            self.fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()

"""Writing files so that a crash never leaves a torn one: the one atomic-write helper.

Every file the package writes (weights, configs, tokenizers, training state, the `latest`
pointer, token caches, compiled kernels) goes through atomic_write, so a kill at any moment
leaves either the old file or the new one.
"""

import os
from pathlib import Path


def atomic_write(path, write) -> None:
    """Call write(tmp_path), then move tmp_path onto path in one step.

    os.replace is atomic on POSIX, so a crash (or a full disk) at any moment leaves either
    the old file or the new one, never a torn mix. The temporary file is removed on failure.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def fsync_dir(path) -> None:
    """Make a rename inside path durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

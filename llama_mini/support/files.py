"""Writing files and folders so that a crash never leaves a torn one.

Every file the package writes (weights, configs, tokenizers, training state, the `latest`
pointer, token caches, compiled kernels, the corpus) goes through atomic_write, and every
checkpoint folder through atomic_folder, so a kill at any moment leaves either the old one or
the new one, only a regular file is ever replaced (never a link, a folder, a FIFO or a device
the user named), and an error names the user's path, never the temporary one.

Beside them, what the readers of formats/ and tokenizers/ share, with nothing heavier than the
standard library: brief (a value from a file, as a message shows it) and is_gguf (a GGUF
file holds both weights and a vocabulary; gguf_file.py reads it).
"""

import errno
import os
import shutil
import stat
from pathlib import Path

import sys


def atomic_write(path, write) -> None:
    """Call write(tmp_path), then move tmp_path onto path in one step.

    os.replace is atomic on POSIX, so a crash (or a full disk) at any moment leaves either
    the old file or the new one, never a torn mix. The temporary file is removed on failure.
    The file gets the mode a new file gets here (0644 under the usual umask) whatever the
    writer gave it: safetensors writes a private file (0600), which would leave the weights
    alone unreadable to the others on a shared machine. A failed write is an OSError naming
    path, also where safetensors reports one as its own error (torch.save: use torch_save).
    """
    path = Path(path)
    check_replaceable(path)
    tmp = temporary_name(path)
    try:
        tmp.touch()  # created as open() creates files: mode 0666 less the umask
        mode = tmp.stat().st_mode
        write(tmp)
        os.chmod(tmp, mode)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise naming(e, path) from None
    except Exception as e:
        if not is_safetensors_error(e):
            raise
        reason = first_line(e).replace(str(tmp), str(path))
        reworded = OSError(f"cannot write {path} ({reason}); is the disk full?")
        reworded.reason = reason
        raise reworded from None
    finally:
        tmp.unlink(missing_ok=True)


def is_safetensors_error(error: Exception) -> bool:
    """Whether error is safetensors' own, which is how it reports a failed write (a full disk, a
    size limit); where safetensors was never imported, no error is."""
    safetensors = sys.modules.get("safetensors")
    return safetensors is not None and isinstance(error, safetensors.SafetensorError)


def torch_save(obj, path) -> None:
    """torch.save(obj, path) for atomic_write; a failed write raises the OSError that failed it,
    where torch reports any failure as a RuntimeError without its cause (a full disk looks like a bug)."""
    import torch  # here: this module loads only the standard library

    with open(path, "wb") as f:
        writer = _RecordingWriter(f)
        try:
            torch.save(obj, writer)
        except RuntimeError:
            if writer.error is None:
                raise
            raise writer.error from None


class _RecordingWriter:
    """A file that keeps the OSError of a failed write."""

    def __init__(self, file):
        self.file, self.error = file, None

    def write(self, data):
        try:
            return self.file.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self):
        self.file.flush()


def atomic_folder(path, write, tmp=None, replacing: bool = False) -> Path:
    """Call write(tmp) on a new hidden folder beside path, then rename it onto path in one step:
    a refusal, a full disk or a kill never leaves a partial folder at path. path must not exist
    or be an empty folder, or, with replacing, be a folder of ours that this one replaces.
    Errors name path, never the hidden folder."""
    target = Path(path).resolve()  # an empty folder, or a link to one, is replaced where it really is
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tmp) if tmp else target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        tmp.mkdir()  # fails if it exists: everything inside it is then ours to remove
    except OSError as e:
        raise OSError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        write(tmp)
        if replacing:
            shutil.rmtree(target, ignore_errors=True)
        os.rename(tmp, target)  # POSIX: replaces an empty folder in one step
    except OSError as e:
        reworded = type(e)(str(e).replace(str(tmp), str(path)))
        reworded.errno, reworded.reason = e.errno, getattr(e, "reason", None)
        raise reworded from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # ours alone: created above, gone once renamed
    fsync_dir(target.parent)
    return Path(path)


def first_line(error: Exception) -> str:
    """The first sentence of a library's error message, to quote inside one line of ours."""
    text = str(error).strip()
    return text.splitlines()[0].split(". ")[0][:300] if text else type(error).__name__


def temporary_name(path: Path) -> Path:
    """Where atomic_write writes path before moving it into place: hidden, beside it, per process."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def check_replaceable(path: Path) -> None:
    """Refuse a path that exists as anything but a regular file: replacing a symlink, a FIFO or
    a device node would destroy what the user keeps there (and as root, /dev/full itself)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISREG(mode):
        return
    kinds = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"))
    kind = next((name for test, name in kinds if test(mode)), "not a regular file")
    raise FileExistsError(f"{path} is {kind}; only a regular file is replaced: name a new file, or remove it first")


def naming(error: OSError, path: Path) -> OSError:
    """error, reworded to name path where it names path's temporary file, or no file at all: the
    user never chose the temporary name and cannot find it afterwards. A short write that gives
    no reason on a full disk says so."""
    tmp = str(temporary_name(path))
    if error.filename is not None and tmp not in (error.filename, error.filename2) and tmp not in str(error):
        return error  # about another file, which it names
    if isinstance(error, FileNotFoundError) and not path.parent.is_dir():
        reason = f"the folder {path.parent} does not exist"
    elif error.errno is None and disk_is_full(path.parent):  # numpy's "32768 requested and 9096 written"
        reason = os.strerror(errno.ENOSPC)
    else:
        reason = error.strerror or str(error).replace(tmp, str(path))
    reworded = type(error)(f"cannot write {path}: {reason}")
    reworded.errno, reworded.reason = error.errno, reason  # the reason alone, for a caller that names the path its own way
    return reworded


def disk_is_full(folder: Path) -> bool:
    """Whether the filesystem of folder has (next to) no space left for this user."""
    try:
        return shutil.disk_usage(folder).free < 1 << 20
    except OSError:
        return False


def check_new_folder(path, fix: str) -> None:
    """Refuse an output folder that exists and is not empty, with fix (what to do instead): a
    command writes only into a new or empty folder, so it never replaces what it did not write
    (train.py's run folder has its own rule, for a run of ours to go on)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} is a file, not a folder; {fix}")
    theirs = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    if theirs:
        listed = ", ".join(theirs[:3]) + (", ..." if len(theirs) > 3 else "")
        raise ValueError(f"{path} is not empty ({listed}); only a new or empty folder is written to: {fix}")


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


def brief(value, limit: int = 40) -> str:
    """A value from a file as an error message shows it: JSON's null, and never a page long."""
    text = "null" if value is None else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


GGUF_MAGIC = b"GGUF"


def is_gguf(file: Path) -> bool:
    """Whether file starts with GGUF's magic (gguf_file.py reads the rest)."""
    with open(file, "rb") as f:
        return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC

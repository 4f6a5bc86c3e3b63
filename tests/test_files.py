"""atomic_write, which every writer of the package goes through: only a regular file is ever
replaced, and a failure names the user's path, never the temporary one."""

import os

import pytest

from llama_mini.support.files import atomic_write


def test_a_regular_file_is_replaced_whole(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("old")
    atomic_write(path, lambda tmp: tmp.write_text("new"))
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def symlink(path):
    path.with_name("theirs.txt").write_text("theirs")
    path.symlink_to(path.with_name("theirs.txt"))


@pytest.mark.parametrize("make, kind", [(symlink, "a symbolic link"), (os.mkfifo, "a FIFO"), (os.mkdir, "a folder")])
def test_nothing_but_a_regular_file_is_replaced(tmp_path, make, kind):
    path = tmp_path / "out.txt"
    make(path)
    with pytest.raises(FileExistsError, match=f"{path} is {kind}; only a regular file is replaced"):
        atomic_write(path, lambda tmp: tmp.write_text("new"))
    assert not path.is_file() or path.is_symlink()
    assert not path.is_symlink() or path.read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out.txt"] + (["theirs.txt"] if make is symlink else []))


def test_a_write_into_a_missing_folder_names_the_users_path(tmp_path):
    path = tmp_path / "missing" / "out.txt"
    with pytest.raises(FileNotFoundError) as error:
        atomic_write(path, lambda tmp: tmp.write_text("new"))
    assert str(error.value) == f"cannot write {path}: the folder {path.parent} does not exist"
    assert error.value.errno == 2


def test_an_error_of_the_writer_itself_is_left_as_it_is(tmp_path):
    """Only errors about the temporary file are reworded: a missing source stays a missing source."""
    with pytest.raises(FileNotFoundError, match="nowhere.txt"):
        atomic_write(tmp_path / "out.txt", lambda tmp: tmp.write_bytes((tmp_path / "nowhere.txt").read_bytes()))
    assert list(tmp_path.iterdir()) == []

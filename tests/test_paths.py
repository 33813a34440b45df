"""Unit tests: where session directories go, how they are checked, made and removed."""

import os
from pathlib import Path

import pytest

from mpsrun.errors import ConfigError, MPSError, UnsafeDirectoryError
from mpsrun.session.paths import SOCKET_PATH_MAX, SessionDirs, base_directory, check_private_dir, longest_socket_path


def test_base_directory_order():
    """MPSRUN_TMPDIR wins over XDG_RUNTIME_DIR, which wins over /tmp."""
    assert base_directory({"MPSRUN_TMPDIR": "/a", "XDG_RUNTIME_DIR": "/b"}) == Path("/a")
    assert base_directory({"XDG_RUNTIME_DIR": "/b"}) == Path("/b")
    assert base_directory({"MPSRUN_TMPDIR": ""}) == Path("/tmp")


def test_create_makes_private_per_gpu_dirs_and_remove_deletes_them(short_tmp):
    """A session gets a 0700 root with pipe and log dirs per GPU; remove() deletes it all."""
    dirs = SessionDirs.create(short_tmp, [0, 3])
    assert dirs.root.parent == short_tmp / f"mpsrun-{os.getuid()}"
    assert (dirs.root.stat().st_mode & 0o777) == 0o700
    assert (dirs.root.parent.stat().st_mode & 0o777) == 0o700
    for index in (0, 3):
        assert dirs.pipe_dir(index).is_dir() and dirs.log_dir(index).is_dir()
        assert len(os.fsencode(dirs.pipe_dir(index) / "control_privileged")) <= SOCKET_PATH_MAX
    assert dirs.record_file.parent == dirs.root and dirs.control_socket.parent == dirs.root
    other = SessionDirs.create(short_tmp, [0])
    assert other.root != dirs.root
    dirs.remove()
    other.remove()
    assert not dirs.root.exists() and not other.root.exists()


def test_too_long_base_is_refused_with_advice(short_tmp):
    """A base whose socket paths would pass 107 bytes raises ConfigError mentioning MPSRUN_TMPDIR."""
    long_base = short_tmp / ("x" * 90)
    long_base.mkdir()
    assert longest_socket_path(long_base) > SOCKET_PATH_MAX
    with pytest.raises(ConfigError, match="too long.*MPSRUN_TMPDIR"):
        SessionDirs.create(long_base, [0])
    assert list(long_base.iterdir()) == []


def test_missing_or_unwritable_base_is_refused(short_tmp):
    """A base that does not exist raises ConfigError (exit 2), one that cannot be written MPSError (exit 3, as
    /proc/self: a base where no directory can be made), before anything is made."""
    with pytest.raises(ConfigError, match="does not exist"):
        SessionDirs.create(short_tmp / "nope", [0])
    locked = short_tmp / "ro"
    locked.mkdir(mode=0o500)
    if os.access(locked, os.W_OK):
        pytest.skip("running as root: permissions do not stop us")
    with pytest.raises(MPSError, match="not writable") as refused:
        SessionDirs.create(locked, [0])
    assert refused.value.exit_code == 3 and not isinstance(refused.value, ConfigError)


@pytest.mark.parametrize("setup", ["symlink", "group_writable", "file"])
def test_unsafe_user_root_is_refused(short_tmp, setup):
    """A user root that is a symlink, group/world-writable or not a directory raises UnsafeDirectoryError."""
    root = short_tmp / f"mpsrun-{os.getuid()}"
    if setup == "symlink":
        target = short_tmp / "elsewhere"
        target.mkdir(mode=0o700)
        root.symlink_to(target)
    elif setup == "group_writable":
        root.mkdir()
        root.chmod(0o770)
    else:
        root.write_text("")
    with pytest.raises(UnsafeDirectoryError, match="refusing to use") as info:
        SessionDirs.create(short_tmp, [0])
    assert info.value.path == str(root)


def test_check_private_dir_accepts_0700(short_tmp):
    """Our own 0700 directory passes the check."""
    path = short_tmp / "ok"
    path.mkdir(mode=0o700)
    check_private_dir(path)


def test_removing_a_session_leaves_a_new_one_of_its_name_alone(short_tmp, monkeypatch):
    """A node session's directory made again under the same name while the old one is being removed (a late rank
    reserving it for a new keeper) survives the old one's removal. It was deleted by the removal's second pass, and
    the new keeper failed with 'cannot make a session directory: No such file or directory' (1 in 200 loaded runs)."""
    from mpsrun.session import paths

    old = SessionDirs.create(short_tmp, [0], name="jnode")
    real_remove, came = paths.remove_tree, []

    def remove_then_a_late_rank_comes(path):
        real_remove(path)
        if not old.root.exists() and not came:
            came.append(True)
            old.root.mkdir()
            (old.root / "reservation").write_text("theirs")

    monkeypatch.setattr(paths, "remove_tree", remove_then_a_late_rank_comes)
    old.remove()
    assert (old.root / "reservation").read_text() == "theirs"
    assert [p.name for p in old.root.parent.iterdir()] == ["jnode"]

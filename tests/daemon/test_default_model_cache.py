"""Where the default model is converted to: a cache directory of ours (or root's) that no one else
writes, made below an existing directory only, with a lock that is never written through a link.
The tests run as root, so "a stranger" is uid nobody (65534); nothing here converts the model."""

import os
import stat

import pytest

from preload_daemon import default_model
from preload_daemon.errors import CheckpointError

NOBODY = 65534


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim"
    path.write_text("precious data")
    return path


@pytest.fixture
def env(monkeypatch):
    for name in ("PRELOAD_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_a_strangers_cache_dir_is_refused_and_its_lock_link_not_followed(tmp_path, env, victim):
    """A root `preload serve` keeping a user's cache directory truncated whatever the planted lock
    named."""
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    (cache / "models" / f".{default_model.NAME}.lock").symlink_to(victim)
    os.chown(cache / "models", NOBODY, NOBODY)
    os.chmod(cache / "models", 0o1777)
    env.setenv("PRELOAD_CACHE_DIR", str(cache))
    with pytest.raises(CheckpointError, match=rf"{cache / 'models'} \(owned by uid {NOBODY}, mode 1777\) is not a "
                                              r"directory of ours.*PRELOAD_CACHE_DIR"):
        default_model.default_model_path()
    assert victim.read_text() == "precious data"


def test_a_lock_that_is_a_link_is_not_followed(tmp_path, env, victim):
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    (cache / "models" / f".{default_model.NAME}.lock").symlink_to(victim)
    env.setenv("PRELOAD_CACHE_DIR", str(cache))
    with pytest.raises(CheckpointError, match=r"cannot open the lock .*\(Too many levels of symbolic links\); "
                                              "remove it"):
        default_model.default_model_path()
    assert victim.read_text() == "precious data"


def test_a_missing_home_is_not_made(tmp_path, env):
    home = tmp_path / "nonexistent"
    env.setenv("HOME", str(home))
    with pytest.raises(CheckpointError, match=rf"cannot make the cache directory {home / '.cache' / 'preload'}: {home} "
                                              "does not exist.*PRELOAD_CACHE_DIR"):
        default_model.default_model_path()
    assert not home.exists()


def test_the_cache_dirs_are_made_private_below_an_existing_home(tmp_path, env):
    env.setenv("HOME", str(tmp_path))
    models = default_model.cache_subdir("models")
    assert models == tmp_path / ".cache" / "preload" / "models"
    for path in (models, models.parent, models.parent.parent):
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o700


def test_a_cache_dir_that_cannot_be_made_is_one_line(env):
    env.setenv("PRELOAD_CACHE_DIR", "/proc/nope")
    with pytest.raises(CheckpointError, match=r"cannot make /proc/nope \(.*\); set PRELOAD_CACHE_DIR"):
        default_model.default_model_path()


def test_benchmarks_keep_their_checkpoints_in_a_directory_of_ours(tmp_path, env):
    """bench attach and bench restart reused whatever checkpoint sat at a fixed /tmp path."""
    from preload_cli.models import bench_dir
    env.setenv("HOME", str(tmp_path))
    assert bench_dir() == tmp_path / ".cache" / "preload" / "bench"
    planted = tmp_path / "planted"
    planted.mkdir(mode=0o777)
    os.chmod(planted, 0o777)
    env.setenv("PRELOAD_BENCH_DIR", str(planted))
    with pytest.raises(SystemExit, match=r"mode 0777\) is not a directory of ours.*PRELOAD_BENCH_DIR"):
        bench_dir()
    env.setenv("PRELOAD_BENCH_DIR", str(tmp_path / "mine"))
    assert bench_dir() == tmp_path / "mine" and stat.S_IMODE(os.lstat(tmp_path / "mine").st_mode) == 0o700


def test_a_cache_dir_named_by_the_user_is_made_with_its_parents(tmp_path, env):
    env.setenv("PRELOAD_CACHE_DIR", str(tmp_path / "a" / "b" / "cache"))
    assert default_model.cache_subdir("bench") == tmp_path / "a" / "b" / "cache" / "bench"
    assert stat.S_IMODE(os.lstat(tmp_path / "a").st_mode) == 0o700


def test_a_group_writable_cache_dir_of_the_users_own_group_is_trusted(tmp_path, env):
    """umask 002 systems (RHEL, Fedora) give each user a group of their own and directories 0775."""
    import grp
    import pwd
    from preload_daemon.errors import InvalidRequestError
    from preload_daemon.runtime_dir import check_trusted_dir
    mine = tmp_path / "mine"
    mine.mkdir()
    os.chmod(mine, 0o775)
    user = pwd.getpwuid(os.geteuid())
    own = grp.getgrgid(user.pw_gid)
    if own.gr_name != user.pw_name or set(own.gr_mem) - {user.pw_name}:
        pytest.skip("this user has no group of its own")
    check_trusted_dir(mine, "plant", "fix")  # root's group, root alone in it
    shared = grp.getgrnam("nogroup").gr_gid if "nogroup" in {g.gr_name for g in grp.getgrall()} else None
    if shared is None:
        pytest.skip("no shared group to try")
    os.chown(mine, -1, shared)
    with pytest.raises(InvalidRequestError, match="mode 0775"):
        check_trusted_dir(mine, "plant", "fix")


def test_root_given_another_users_home_makes_nothing_there(tmp_path, env):
    """`sudo -E preload default-model`: root made a root-owned 0700 ~/.cache in the user's home,
    refused, and left it, locking the user (and pip) out of their own cache directory."""
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, NOBODY, NOBODY)
    env.setenv("HOME", str(home))
    with pytest.raises(CheckpointError, match=rf"{home}, above .*, belongs to uid {NOBODY}"):
        default_model.default_model_path()
    assert not list(home.iterdir())

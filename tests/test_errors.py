"""Unit tests: the exception hierarchy carries data and survives pickling."""

import pickle

import pytest

from mpsrun import errors


def test_errors_derive_from_matching_builtins():
    """Callers can catch mpsrun errors as the builtin they resemble, or all as MPSError."""
    assert issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.GPUNotFoundError, ValueError)
    assert issubclass(errors.DaemonTimeoutError, TimeoutError)
    assert issubclass(errors.UnsafeDirectoryError, PermissionError)
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.MPSError)


@pytest.mark.parametrize(
    "exc",
    [
        errors.DaemonError("quit failed", command="quit", reply="Not enough privilege", log_tail="x"),
        errors.NotMPSClientError("strays", pids=[4, 5], gpu="GPU-1"),
        errors.ConfigError("bad", setting="mem_limit", value="12Q"),
        errors.TeardownError("teardown", errors=[OSError("busy")]),
    ],
)
def test_errors_pickle_with_their_data(exc):
    """Errors cross process boundaries (multiprocessing) with message and attributes intact."""
    copy = pickle.loads(pickle.dumps(exc))
    assert type(copy) is type(exc)
    assert str(copy) == str(exc)
    assert copy._data.keys() == exc._data.keys()
    for key in exc._data:
        assert repr(getattr(copy, key)) == repr(getattr(exc, key))

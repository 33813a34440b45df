"""One copy, many ranks: read-only arrays that every rank (or worker) on a GPU shares.

    from mpsrun import shared
    table = shared.array("xs-table", (1 << 28,), "float32", init=load_table)  # a CuPy array

In an ``mpsrun`` job (or in the workers of ``mps_session()``), the first caller on each GPU
allocates the array from an IPC-enabled CUDA memory pool and fills it (``init(out)``, or
``data``); every other caller on that GPU waits until it is filled and gets a zero-copy view of
the same device memory. Sixteen ranks that need a 2 GiB table then use 2 GiB, not 32.

The memory's handle (a file descriptor) travels only through a UNIX socket in the job's private
0700 session directory: another user cannot reach it, and so cannot map the memory. Without a
GPU (no CuPy, no ``cuda.core`` or no device) the array is host memory shared the same way, as a
read-only NumPy array, and the first call says so.

**Do not write to a shared array** except in ``init``: every rank on the GPU sees the same memory,
and a write races with their reads (undefined). CuPy has no read-only arrays; the NumPy fallback's
views are read-only.

Lifetime: a rank's hold ends with :func:`release` or with the process. The filling rank's
:func:`release` waits until the others have released theirs. When it ends first, the memory stays
mapped for those still using it (the driver counts the mappings; measured under MPS on the H100)
and one of them publishes it for ranks still to come; it goes with the last of them. The
sockets and locks live in the session directory, which the job's teardown removes.
"""

from __future__ import annotations

import atexit
import base64
import hashlib
import json
import logging
import math
import operator
import os
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mpsrun.errors import SharedArrayError
from mpsrun.runtime.constants import SESSION_DIR_VARIABLE
from mpsrun.runtime.deadline import Deadline
from mpsrun.session.paths import SOCKET_PATH_MAX
from mpsrun.shared.handoff import HandoffError, Publisher, Subscription, join, take_over
from mpsrun.shared.memory import Memory, Region, memory_for_this_process

__all__ = ["DEFAULT_TIMEOUT", "SharedArrayError", "array", "release", "role"]

log = logging.getLogger("mpsrun")

DEFAULT_TIMEOUT = 600.0  # how long a rank waits for the array to be filled (loading a large table takes a while)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


class _Held:
    """One shared array in this process: its memory, its view, and our side of the handoff (``kept``: the
    subscription of a rank that took over publishing when the first publisher ended)."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: Any, region: Region,
                 holder: Publisher | Subscription, key: str = "") -> None:
        self.name, self.shape, self.dtype, self.region, self.holder = name, shape, dtype, region, holder
        self.key = key
        self.kept: Subscription | None = None
        self.array = region.view(shape, dtype, writable=False)  # where the library allows a read-only view

    def let_go(self) -> None:
        """End our side of the handoff (never waiting) and keep nothing open."""
        if isinstance(self.holder, Publisher):
            self.holder.close()
        else:
            self.holder.release()
        if self.kept is not None:
            self.kept.release()


_held: dict[str, _Held] = {}
_guard = threading.Lock()  # over _held only: never held while waiting
_getting: dict[str, threading.Lock] = {}  # one per name: a second thread asking for it waits for the first
_memory: tuple[Memory, str | None] | None = None
_local = threading.local()
#: NumPy's own limit (NPY_MAXDIMS) is 32 before NumPy 2 and 64 since: the smaller works with either.
_MAX_DIMENSIONS = 32


def array(name: str, shape: int | Sequence[int], dtype: Any, *, init: Callable[[Any], object] | None = None,
          data: Any = None, timeout: float | None = DEFAULT_TIMEOUT) -> Any:
    """The array ``name`` of this job on this process's GPU: filled once per GPU, shared by every caller there.

    Args:
        name: what the ranks call it (letters, digits, ``.``, ``_``, ``-``).
        shape, dtype: the array's; every caller must ask for the same.
        init: called with the (writable) array to fill in place, by the rank that fills it: the first caller
            on the GPU (again only if every holder has ended, or the fill failed, before another rank asks).
        data: or an array (NumPy or CuPy) to copy in; with neither, the array is zeros.
        timeout: seconds to wait for the filling rank (None: as long as it takes).

    Raises :class:`SharedArrayError` outside an mpsrun job or ``mps_session()``, for a bad argument, when the
    ranks ask for different shapes, when the filling rank failed (with its reason), or after ``timeout``.
    """
    shape, kind = _arguments(name, shape, dtype, init, data, timeout)
    if math.prod(shape) == 0:  # nothing to share: an empty array of the kind the others get
        return _empty(shape, kind)
    if name in _filling():
        raise SharedArrayError(f"shared array {name!r}: its init asks for {name!r} itself (it is being filled "
                               "by this very call)", name=name)
    with _guard:
        getting = _getting.setdefault(name, threading.Lock())
    deadline = Deadline(timeout)
    if not getting.acquire(timeout=-1 if timeout is None else deadline.remaining()):
        raise SharedArrayError(f"shared array {name!r}: another thread of this process still got it after "
                               f"{timeout:g} s", name=name)
    try:
        with _guard:
            held = _held.get(name)
        if held is None:
            held = _share(name, shape, kind, init, data, deadline)
            with _guard:
                _held[name] = held
    finally:
        getting.release()
    _check(held.name, held.shape, _to_descr(held.dtype), shape, kind, "this process")
    return held.array


def _arguments(name: Any, shape: Any, dtype: Any, init: Any, data: Any, timeout: Any) -> tuple[tuple[int, ...], Any]:
    """The shape as a tuple of ints and the NumPy dtype; SharedArrayError for what cannot be shared."""
    import numpy

    def refuse(why: str) -> SharedArrayError:
        return SharedArrayError(f"shared array {name!r}: {why}", name=str(name))

    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise refuse("a name is up to 100 letters, digits, '.', '_' or '-'")
    try:
        dims = [shape] if numpy.ndim(shape) == 0 else list(shape)
        sizes = tuple(_size(n) for n in dims)
        kind = numpy.dtype(dtype)
        total = math.prod(sizes) * kind.itemsize
    except (TypeError, ValueError, OverflowError) as exc:
        raise refuse(f"a shape of whole sizes and a NumPy dtype ({exc})") from None
    if any(n < 0 for n in sizes) or kind.hasobject or total >= 1 << 62:
        raise refuse("non-negative sizes of a plain dtype (no Python objects), under 4 EiB")
    if len(sizes) > _MAX_DIMENSIONS or kind.itemsize == 0 or kind.subdtype is not None:
        raise refuse(f"at most {_MAX_DIMENSIONS} dimensions, of a dtype with a size and no sub-array "
                     f"({len(sizes)} dimensions of {kind!r} asked for)")
    if init is not None and data is not None:
        raise refuse("init or data, not both")
    if data is not None and tuple(getattr(data, "shape", numpy.shape(data))) != sizes:
        raise refuse(f"data of shape {tuple(getattr(data, 'shape', numpy.shape(data)))}, not the {sizes} asked for")
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout >= 0):
        raise refuse(f"timeout is seconds (>= 0) or None, not {timeout!r}")
    return sizes, kind


def role(name: str) -> str | None:
    """This process's part in the array ``name``: ``"publisher"`` (it filled the array, or took over serving it to
    the ranks still to come when the filler ended: its :func:`release` waits for the others), ``"subscriber"``
    (it maps another rank's array), or None (it does not hold it)."""
    with _guard:
        held = _held.get(name)
    if held is None:
        return None
    return "publisher" if isinstance(held.holder, Publisher) else "subscriber"


def release(name: str, timeout: float | None = None) -> None:
    """Give up this process's hold on ``name``; the array must not be used afterwards.

    The rank that filled it first waits (up to ``timeout`` seconds; by default as long as it takes)
    until every other rank on its GPU has released it, then frees the memory.
    """
    with _guard:
        held = _held.pop(name, None)
    if held is None:
        return
    if isinstance(held.holder, Publisher) and not held.holder.wait_released(Deadline(timeout)):
        users = held.holder.subscribers
        held.let_go()
        raise SharedArrayError(f"shared array {name!r}: {users} rank(s) still used it after {timeout:g} s; its "
                               "memory stays until they end", name=name)
    held.region.close()
    held.let_go()


def _filling() -> set[str]:
    """The names this thread is filling now (an init that asks for its own array would wait for itself)."""
    if not hasattr(_local, "filling"):
        _local.filling = set()
    filling: set[str] = _local.filling
    return filling


def _size(n: Any) -> int:
    if isinstance(n, bool):
        raise TypeError(f"{n!r} is not a size")
    return operator.index(n)  # ints and NumPy integers; never a float cut short


def _share(name: str, shape: tuple[int, ...], dtype: Any, init: Callable[[Any], object] | None, data: Any,
           deadline: Deadline) -> _Held:
    """The array, shared; the machine's refusals (too many open files, no memory, no such directory) are this
    array's error, in one line."""
    try:
        return _share_now(name, shape, dtype, init, data, deadline)
    except OSError as exc:
        raise SharedArrayError(f"shared array {name!r}: {exc.strerror or exc}"
                               + (f": {exc.filename}" if exc.filename else ""), name=name) from None


def _share_now(name: str, shape: tuple[int, ...], dtype: Any, init: Callable[[Any], object] | None, data: Any,
               deadline: Deadline) -> _Held:
    memory = _this_memory()
    directory = _directory()
    # As short as a session's own MPS sockets, whose length was checked: 16 characters, then ".sock".
    key = memory.device_key() + hashlib.sha256(name.encode()).hexdigest()[:8]
    nbytes = math.prod(shape) * dtype.itemsize
    if len(str(directory / f"{key}.sock").encode()) > SOCKET_PATH_MAX:
        raise SharedArrayError(f"shared array {name!r}: the session directory {directory.parent} is too long for a "
                               "socket path; set MPSRUN_TMPDIR to a shorter directory", name=name)
    limit = memory.max_bytes()
    if limit is not None and nbytes > limit:
        raise SharedArrayError(f"shared array {name!r} would be {nbytes / (1 << 30):.1f} GiB; one shared array "
                               f"holds at most {limit / (1 << 30):.3g} GiB here ({memory.why_limited})", name=name)
    try:
        holder = join(directory, key, deadline)
    except HandoffError as exc:
        raise SharedArrayError(f"shared array {name!r}: {exc}", name=name) from None
    if isinstance(holder, Publisher):
        return _publish(name, shape, dtype, memory, holder, init, data)  # the first caller on this GPU
    try:
        header = holder.header
        _check(name, tuple(header["shape"]), header["dtype"], shape, dtype, f"rank {header.get('rank')}")
        region = memory.attach(os.dup(holder.fd), base64.b64decode(header["descriptor"]), nbytes)
    except BaseException:
        holder.release()
        raise
    holder.watch(lambda: _take_over(name, directory))
    return _Held(name, shape, dtype, region, holder, key)


def _take_over(name: str, directory: Path) -> None:
    """Our publisher ended while we hold the array: publish the same memory for the ranks still to come."""
    with _guard:
        held = _held.get(name)
    if held is None or not isinstance(held.holder, Subscription):
        return
    subscription = held.holder
    publisher = take_over(directory, held.key, subscription)  # may wait a moment: not under the guard
    if publisher is None:
        return
    with _guard:
        if _held.get(name) is held and held.holder is subscription:
            held.kept, held.holder = subscription, publisher
            return
    publisher.close()  # released meanwhile


def _publish(name: str, shape: tuple[int, ...], dtype: Any, memory: Memory, publisher: Publisher,
             init: Callable[[Any], object] | None, data: Any) -> _Held:
    nbytes = math.prod(shape) * dtype.itemsize
    rank = os.environ.get("RANK", str(os.getpid()))
    region: Region | None = None
    try:
        region, fd, descriptor = memory.allocate(nbytes)
        out = region.view(shape, dtype)  # writable: for the fill only
        if init is not None:
            _filling().add(name)
            try:
                init(out)
            finally:
                _filling().discard(name)
        elif data is not None:
            out[...] = data
        else:
            out[...] = 0
        memory.settle()
        del out
        held = _Held(name, shape, dtype, region, publisher)
    except BaseException as exc:
        publisher.fail(f"rank {rank} could not fill it: {exc!r}")
        publisher.close()
        if region is not None:
            region.close()
        raise
    publisher.publish({"shape": list(shape), "dtype": _to_descr(dtype), "nbytes": nbytes, "rank": rank,
                       "descriptor": base64.b64encode(descriptor).decode()}, fd)
    return held


def _to_descr(dtype: Any) -> Any:
    """A dtype as JSON (structure and byte order kept: ``numpy.lib.format``'s description), as the header has it."""
    from numpy.lib import format as npy

    return json.loads(json.dumps(npy.dtype_to_descr(dtype)))


def _empty(shape: tuple[int, ...], dtype: Any) -> Any:
    if _this_memory().kind == "cuda":
        import cupy

        return cupy.empty(shape, dtype)
    import numpy

    return numpy.empty(shape, dtype)


def _check(name: str, shape: tuple[int, ...], descr: Any, wanted: tuple[int, ...], wanted_dtype: Any,
           who: str) -> None:
    """``descr``: the dtype as :func:`_to_descr` gives it (so structured dtypes compare whole)."""
    if tuple(shape) != wanted or descr != _to_descr(wanted_dtype):
        raise SharedArrayError(f"shared array {name!r} is {tuple(shape)} {_readable(descr)} for {who}, but "
                               f"{wanted} {_readable(_to_descr(wanted_dtype))} was asked for here", name=name)


def _readable(descr: Any) -> str:
    import numpy

    return str(numpy.dtype(descr)) if isinstance(descr, str) else str(descr)


def _this_memory() -> Memory:
    global _memory
    if _memory is None:
        _memory = memory_for_this_process()
        if _memory[1] is not None and _first_to_say("host-memory"):
            log.warning("mpsrun.shared.api: %s: sharing host memory as read-only NumPy arrays", _memory[1])
    return _memory[0]


def _first_to_say(notice: str) -> bool:
    """Whether this process is the session's first to give ``notice`` (said once per node, not once per rank)."""
    session = os.environ.get(SESSION_DIR_VARIABLE)
    try:
        if session:
            os.close(os.open(os.path.join(session, f"said.{notice}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        return False
    except OSError:  # an unusable session directory: the call fails next, with its own message
        pass
    return True


def _directory() -> Path:
    """``shared/`` in the job's private session directory (made 0700 on first use)."""
    session = os.environ.get(SESSION_DIR_VARIABLE)
    if not session:
        raise SharedArrayError("mpsrun.shared works in the ranks of an mpsrun job or the workers of an "
                               "mps_session() that runs MPS (MPSRUN_SESSION_DIR is not set)")
    directory = Path(session) / "shared"
    try:
        directory.mkdir(mode=0o700, exist_ok=True)  # the umask can only make it stricter
        info = directory.lstat()
    except OSError as exc:
        raise SharedArrayError(f"mpsrun.shared: cannot use {directory} ({exc.strerror}); is {SESSION_DIR_VARIABLE} "
                               "the job's session directory?") from None
    if not directory.is_dir() or directory.is_symlink() or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise SharedArrayError(f"{directory} is not a private directory of this user")
    return directory


def _forget_in_child() -> None:
    """A forked child holds none of our arrays (CUDA contexts do not survive a fork) and none of our locks."""
    global _guard
    _guard = threading.Lock()
    _held.clear()
    _getting.clear()


os.register_at_fork(after_in_child=_forget_in_child)


@atexit.register
def _at_exit() -> None:
    """At exit nobody waits: subscribers let go, the publisher stops serving (its memory stays mapped for whoever
    still uses it, and goes with the last of them)."""
    with _guard:
        for held in _held.values():
            held.let_go()
        _held.clear()

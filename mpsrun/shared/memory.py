"""Memory that one process allocates and others on the same device map: the part of :mod:`mpsrun.shared.api` that
talks to CUDA (or, without a GPU, to the host).

* :class:`CudaMemory`: an IPC-enabled stream-ordered memory pool from NVIDIA's ``cuda.core``
  (``cudaMemPoolExportToShareableHandle`` with a POSIX file descriptor, then
  ``cudaMemPoolExportPointer``/``ImportPointer``), seen as a CuPy array. Measured working between
  MPS clients on the H100 (docs/benchmarks.md); CuPy alone has no pool export.
* :class:`HostMemory`: a ``memfd`` mapped by every process, seen as a NumPy array (read-only where
  attached): the fallback without a GPU.

Either way a region travels as one file descriptor plus a small descriptor (bytes).
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import pickle
from typing import Any, Protocol

__all__ = ["CudaMemory", "HostMemory", "Memory", "Region", "memory_for_this_process"]


class Region(Protocol):
    """An allocation (exported) or a mapping of one (attached)."""

    def view(self, shape: tuple[int, ...], dtype: Any, writable: bool = True) -> Any: ...

    def close(self) -> None: ...


class Memory(Protocol):
    kind: str  # "cuda" or "host"
    why_limited: str  # what limits a region's size

    def max_bytes(self) -> int | None: ...  # the largest region that can be shared now, where there is a limit

    def device_key(self) -> str: ...  # eight characters naming the device (socket paths are short)

    def allocate(self, nbytes: int) -> tuple[Region, int, bytes]: ...

    def attach(self, fd: int, descriptor: bytes, nbytes: int) -> Region: ...

    def settle(self) -> None: ...


class _CudaRegion:
    def __init__(self, buffer: Any, resource: Any, cupy: Any, handle: Any = None) -> None:
        self.buffer, self.resource, self.cupy = buffer, resource, cupy
        self.handle = handle  # an exported pool's descriptor lives as long as this object

    def view(self, shape: tuple[int, ...], dtype: Any, writable: bool = True) -> Any:
        # Zero-copy: DLPack hands CuPy the buffer's memory (bytes), viewed as the array asked for. CuPy has no
        # read-only arrays: ``writable`` cannot be honoured here.
        return self.cupy.from_dlpack(self.buffer).view(self.cupy.uint8).view(dtype).reshape(shape)

    def close(self) -> None:
        self.buffer.close()
        self.resource.close()


class CudaMemory:
    """The current CUDA device, through ``cuda.core`` and CuPy."""

    kind = "cuda"
    why_limited = "importing larger ones crashed the CUDA 13.0 driver: split it into several arrays"

    def max_bytes(self) -> int | None:
        """Measured on the H100 (driver 580.159, CUDA 13.0), with and without MPS: importing a pool pointer of
        4.5 GiB works, of 6 GiB or more the importing process dies in ``cuMemPoolImportPointer`` (SIGSEGV)."""
        return 4 << 30

    def __init__(self) -> None:
        import cupy
        from cuda import core

        self.cupy, self.core = cupy, core
        self.device = core.Device(cupy.cuda.runtime.getDevice())
        self.device.set_current()

    def device_key(self) -> str:
        return hashlib.sha256(str(self.device.uuid).encode()).hexdigest()[:8]

    def allocate(self, nbytes: int) -> tuple[Region, int, bytes]:
        granule = 2 << 20  # pools grow in 2 MiB steps
        options = self.core.DeviceMemoryResourceOptions(ipc_enabled=True, max_size=-(-nbytes // granule) * granule)
        resource = self.core.DeviceMemoryResource(self.device, options)
        buffer = resource.allocate(nbytes, stream=self.device.default_stream)
        descriptor = pickle.dumps(buffer.ipc_descriptor)  # the pool's pointer export: plain bytes
        handle = resource.allocation_handle
        return _CudaRegion(buffer, resource, self.cupy, handle), int(handle.handle), descriptor

    def attach(self, fd: int, descriptor: bytes, nbytes: int) -> Region:
        try:
            resource = self.core.DeviceMemoryResource.from_allocation_handle(self.device, fd)
        finally:
            os.close(fd)  # imported: the pool holds what it needs
        buffer = self.core.Buffer.from_ipc_descriptor(resource, pickle.loads(descriptor),  # noqa: S301 - from our
                                                      stream=self.device.default_stream)  # own 0700 session socket
        if buffer.size < nbytes:
            raise ValueError(f"the shared buffer holds {buffer.size} bytes, not {nbytes}")
        return _CudaRegion(buffer, resource, self.cupy)

    def settle(self) -> None:
        """The fill is done: wait for it, and give back to the device what it left in CuPy's pool (a table
        filled through a temporary would otherwise hold its size twice)."""
        self.device.sync()
        self.cupy.get_default_memory_pool().free_all_blocks()


class _HostRegion:
    def __init__(self, mapping: mmap.mmap, writable: bool, fd: int | None = None) -> None:
        self.mapping, self.writable, self.fd = mapping, writable, fd

    def view(self, shape: tuple[int, ...], dtype: Any, writable: bool = True) -> Any:
        import numpy

        array = numpy.frombuffer(self.mapping, dtype=dtype, count=int(numpy.prod(shape))).reshape(shape)
        array.flags.writeable = self.writable and writable
        return array

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        with contextlib.suppress(BufferError):  # a view is still alive: the mapping goes with it
            self.mapping.close()


class HostMemory:
    """Host memory (a ``memfd``), as NumPy arrays: what ranks without a GPU share."""

    kind = "host"
    why_limited = "the host's available memory"

    def max_bytes(self) -> int | None:
        """What the host has available now: more would be filled until the kernel's OOM killer ends the rank."""
        import psutil

        return int(psutil.virtual_memory().available)

    def device_key(self) -> str:
        return "hostmemo"  # eight characters, as a GPU's key

    def allocate(self, nbytes: int) -> tuple[Region, int, bytes]:
        fd = os.memfd_create("mpsrun-shared", os.MFD_CLOEXEC)
        os.ftruncate(fd, max(nbytes, 1))
        return _HostRegion(mmap.mmap(fd, max(nbytes, 1)), writable=True, fd=fd), fd, b""

    def attach(self, fd: int, descriptor: bytes, nbytes: int) -> Region:
        try:
            return _HostRegion(mmap.mmap(fd, max(nbytes, 1), prot=mmap.PROT_READ), writable=False)
        finally:
            os.close(fd)

    def settle(self) -> None:
        pass


def memory_for_this_process() -> tuple[Memory, str | None]:
    """CUDA memory where CuPy, ``cuda.core`` and a device are usable; else host memory and the reason why."""
    try:
        return CudaMemory(), None
    except ImportError as exc:
        return HostMemory(), f"{exc.name or exc} is not installed"
    except Exception as exc:  # no driver, no device: CuPy and cuda.core raise their own errors
        return HostMemory(), f"no usable CUDA device ({type(exc).__name__}: {exc})"

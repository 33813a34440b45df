"""A test double of NVIDIA's ``cuda.core`` for machines without a GPU: the IPC-enabled memory pools that
``mpsrun.shared.api`` uses, with real file descriptors.

A pool is a ``memfd`` (its allocation handle is that descriptor, as ``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``
is), a buffer is a page-aligned stretch of it, and importing a pool or a buffer maps the same ``memfd``. So
the memory really is one copy, and a process without the descriptor cannot map it. Every allocation is logged
to ``$FAKE_CUDA_LOG`` (``pid bytes device``) so tests can count the copies.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass


class Device:
    def __init__(self, device_id: int = 0) -> None:
        self.device_id = device_id
        visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
        self.uuid = visible[device_id] if device_id < len(visible) else f"GPU-fake-{device_id}"
        self.default_stream = object()

    def set_current(self) -> None:
        pass

    def sync(self) -> None:
        pass


@dataclass
class DeviceMemoryResourceOptions:
    ipc_enabled: bool = False
    max_size: int = 0


class IPCAllocationHandle:
    def __init__(self, fd: int) -> None:
        self.handle = fd


@dataclass(frozen=True)
class IPCBufferDescriptor:
    offset: int
    size: int


class DeviceMemoryResource:
    def __init__(self, device: Device, options: DeviceMemoryResourceOptions | None = None) -> None:
        self.device = device
        self.fd = os.memfd_create("fake-cuda-pool", os.MFD_CLOEXEC)
        self.max_size = options.max_size if options else 0
        os.ftruncate(self.fd, self.max_size)
        self.used = 0
        self.mapped = False

    @property
    def allocation_handle(self) -> IPCAllocationHandle:
        return IPCAllocationHandle(self.fd)

    @classmethod
    def from_allocation_handle(cls, device: Device, fd: int) -> DeviceMemoryResource:
        pool = cls.__new__(cls)
        pool.device, pool.fd, pool.max_size, pool.used, pool.mapped = device, os.dup(fd), 0, 0, True
        return pool

    def allocate(self, size: int, *, stream: object) -> Buffer:
        if self.mapped or self.used + size > self.max_size:
            raise MemoryError(f"fake pool: cannot allocate {size} bytes (mapped={self.mapped})")
        offset, self.used = self.used, self.used + -(-size // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY
        if os.environ.get("FAKE_CUDA_LOG"):
            with open(os.environ["FAKE_CUDA_LOG"], "a") as log:
                log.write(f"{os.getpid()} {size} {self.device.uuid}\n")
        return Buffer(self, offset, size)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Buffer:
    def __init__(self, pool: DeviceMemoryResource, offset: int, size: int) -> None:
        self.pool, self.offset, self.size = pool, offset, size
        self._map = mmap.mmap(pool.fd, max(size, 1), offset=offset)

    @property
    def ipc_descriptor(self) -> IPCBufferDescriptor:
        return IPCBufferDescriptor(self.offset, self.size)

    @classmethod
    def from_ipc_descriptor(cls, pool: DeviceMemoryResource, descriptor: IPCBufferDescriptor, *,
                            stream: object) -> Buffer:
        return cls(pool, descriptor.offset, descriptor.size)

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # an array still views it: it goes with the array
            self._map.close()

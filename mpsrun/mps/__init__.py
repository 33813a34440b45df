"""NVIDIA MPS itself: the control daemon, what it says, the GPUs, and proof that ranks are its clients.

Owns: one ``nvidia-cuda-mps-control`` and its life cycle (:mod:`~mpsrun.mps.daemon`), its replies and log
lines as recorded on an H100 (:mod:`~mpsrun.mps.replies`), the GPUs through NVML (:mod:`~mpsrun.mps.gpus`),
the client watch (:mod:`~mpsrun.mps.watch`), a worker's MPS variables (:mod:`~mpsrun.mps.environment`) and
the limits' arithmetic (:mod:`~mpsrun.mps.limits`).

Imports: the standard library, nvidia-ml-py and psutil, :mod:`mpsrun.config` (types only),
:mod:`mpsrun.runtime` and the bottom layer.
"""

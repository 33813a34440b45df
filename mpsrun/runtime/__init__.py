"""What every mpsrun process runs on: the event loop, processes, the protocol, deadlines, output, constants.

Owns: the one event loop (:mod:`~mpsrun.runtime.loop`), signals outside it
(:mod:`~mpsrun.runtime.interrupts`), processes by pid and start time (:mod:`~mpsrun.runtime.processes`),
the protocol between a job's processes with its message declarations (:mod:`~mpsrun.runtime.protocol`),
deadlines (:mod:`~mpsrun.runtime.deadline`), reading logs a rank can reach
(:mod:`~mpsrun.runtime.files`), the command's own lines and tagged rank output
(:mod:`~mpsrun.runtime.output`), and what every process of a job must agree on: signals, waits and
variable names (:mod:`~mpsrun.runtime.constants`).

Imports: the standard library, :mod:`mpsrun.errors` and :mod:`mpsrun.exitcodes` only (every rank
supervisor runs on it).
"""

"""A session: the private directory, the MPS daemons it holds, and everything that ends them, whoever dies.

Owns: private per-session directories (:mod:`~mpsrun.session.paths`), a session's claim on its directory
with its reaper (:mod:`~mpsrun.session.claim`, :mod:`~mpsrun.session.reaper`), a node session's directory reserved
for its keeper (:mod:`~mpsrun.session.reservation`), the typed record
(:mod:`~mpsrun.session.record`), a session's daemons (:mod:`~mpsrun.session.daemonset`), the variables a
session exports (:mod:`~mpsrun.session.export`), this user's sessions on the node for ``mpsrun status`` and
``mpsrun cleanup`` (:mod:`~mpsrun.session.registry`), and :class:`~mpsrun.session.session.Session`, the one
daemon life cycle of ``mps_session()``, the launcher and node keepers.

Imports: the standard library, psutil, :mod:`mpsrun.mps`, :mod:`mpsrun.config`,
:mod:`mpsrun.runtime` and the bottom layer.
"""

"""``--per-node``: one node's ranks sharing the node's MPS session, under srun, mpiexec or ``mpsrun --hosts``.

Owns: what a rank's ``mpsrun --per-node`` does (:mod:`~mpsrun.node.pernode`: find or start the node's
keeper, then run the rank), the node keeper that owns the node's session (:mod:`~mpsrun.node.keeper`),
and its controllers: one that judges the node's ranks (:mod:`~mpsrun.node.controller`) and one that relays
them to a multi-host job's controller (:mod:`~mpsrun.node.relay`).

Imports: :mod:`mpsrun.job` (the controllers' common part, placement, reports) and everything below it.
"""

"""The agent: one node's part of a job, on every path (torch elastic's shape: an agent per node).

Owns: the agent (:mod:`~mpsrun.agent.agent`: a node's session opened and closed, its ranks planned, welcomed,
watched, stopped and given their verdicts), the peers that join it (:mod:`~mpsrun.agent.ranks`), the decision of what a
job's events mean (:mod:`~mpsrun.agent.decision`, :mod:`~mpsrun.agent.outcome`), the placement of ranks on GPUs with
their limits and the one rank environment (:mod:`~mpsrun.agent.welcome`), each rank's account and the report
(:mod:`~mpsrun.agent.account`), what a job's end says of MPS (:mod:`~mpsrun.agent.findings`), and the agent as a
process of its own under ``--per-node`` and ``--hosts`` (:mod:`~mpsrun.agent.keeper`, with the ranks it awaits:
:mod:`~mpsrun.agent.arrivals`) with the rank's side that finds or starts it (:mod:`~mpsrun.agent.pernode`).

Imports: :mod:`mpsrun.session`, :mod:`mpsrun.mps`, :mod:`mpsrun.rank`, :mod:`mpsrun.config`, :mod:`mpsrun.runtime`
and the bottom layer; never :mod:`mpsrun.job` (the command, which builds on it).
"""

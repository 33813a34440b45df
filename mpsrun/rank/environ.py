"""The environment a rank runs with: the caller's, plus what its welcome gives (the README's list).

Standard library only (the supervisor starts with ``python -S``).
"""

from __future__ import annotations

from collections.abc import Mapping

from mpsrun.runtime.constants import ABORT_SOCKET_VARIABLE, CONTROL_VARIABLES, JOB_ID_VARIABLE, WORLD_VARIABLE
from mpsrun.runtime.protocol import Welcome

__all__ = ["rank_env"]


def rank_env(base: Mapping[str, str], welcome: Welcome) -> dict[str, str]:
    """The rank's environment: ours, less what mpsrun manages, with the caller's values of what an MPI launcher
    rewrites put back (``restore``: None for one the caller did not set), plus what the controller gave (``env``;
    each group of ``defaults`` only where the rank's environment has none of its names)."""
    managed = set(welcome.managed) | set(CONTROL_VARIABLES) | {JOB_ID_VARIABLE, ABORT_SOCKET_VARIABLE, WORLD_VARIABLE}
    env = {k: v for k, v in base.items() if k not in managed}
    for name, value in welcome.restore.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    for group in welcome.defaults:
        if not any(name in env for name in group):
            env.update(group)
    env.update(welcome.env)
    return env

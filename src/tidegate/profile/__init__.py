"""The capacity planner: ``tidegate profile`` measures a model and writes its operating config.

Pieces, in the order a run uses them:

- ``options``: what was asked, checked before anything starts;
- ``workload``: the request mix (a trace's token lengths, or the synthetic distribution);
- ``server``: the worker processes the planner starts, or the server at ``--url``;
- ``loadgen``: the closed-loop load generator; ``resources``: CPU, memory, batch counters;
- ``measure``: one point, in windows until stable; ``sweep``: which points, when to stop;
- ``recommend``: knees and settings; ``outputs``, ``report`` and ``plots``: the four files;
- ``run``: the progress bar, Ctrl-C, and writing the files whatever happened.

The rules themselves (stability, stop climbing, the knee) are pure functions in
``tidegate.core.capacity``. docs/profile.md is the user's guide.
"""

from __future__ import annotations

from tidegate.profile.options import ProfileOptions
from tidegate.profile.run import run_profile

__all__ = ["ProfileOptions", "run_profile"]

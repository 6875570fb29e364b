"""This process's rank once its group formed (rank, world size, backend, device, collective timeout).

One dict the rank-side modules share, kept apart from ``context`` so that a low module (the GPU probe,
which ``control`` warms at group formation) reads it without importing the group's machinery: an import
cycle otherwise (context -> control -> probe_fused -> context)."""

from __future__ import annotations

from typing import Any

RANK: dict[str, Any] = {}

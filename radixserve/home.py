"""Where radixserve keeps what it fetches and builds on this machine (models, compiled kernels).

A module of its own so that both model/ (fetched models) and kernels/ (the built library) can
ask it without importing each other.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    """Where radixserve keeps fetched models and built kernels: $RADIXSERVE_HOME or
    ~/.cache/radixserve."""
    return Path(os.environ.get("RADIXSERVE_HOME") or Path.home() / ".cache" / "radixserve")

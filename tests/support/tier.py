"""The disk KV tier's test fixtures: a model fingerprint for small blocks, and running a
system command (mounts, filesystems) that may be refused."""

from __future__ import annotations

import subprocess

from radixserve.kv_tier.blocks import ModelFingerprint

FINGERPRINT = ModelFingerprint(
    weights="0123456789abcdef0123456789abcdef", dtype="float32", quantization="none",
    projections="torch", attention="sdpa", num_layers=2, num_kv_heads=1, head_dim=8,
    page_size=4, block_tokens=4, software="radixserve-test",
)


def run_command(*command: str) -> str | None:
    """Runs a command; None when it worked, else why not."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return None if done.returncode == 0 else (done.stderr.strip() or f"exit {done.returncode}")

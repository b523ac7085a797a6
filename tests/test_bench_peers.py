"""benchmarks/peers.py plans the same runs for every system; a dry run starts nothing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "peers.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("peers", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["peers"] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


def test_dry_run_plans_every_system_alike(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    peers = _load()
    status = peers.main(
        [
            "--dry-run",
            "--out",
            str(tmp_path),
            "--model",
            "m.gguf",
            "--systems",
            "radix,hash,off,llama-cpp-python",
            "--peer",
            "other=http://127.0.0.1:9",
            "--only",
            "shared-prefix",
        ]
    )
    assert status == 0
    lines = capsys.readouterr().out.splitlines()
    benches = [line for line in lines if line.startswith("radixserve bench")]
    assert len(benches) == 5 * 2  # five systems, shared-prefix at concurrency 1 and 5
    for line in benches:  # the same workload flags for everyone
        assert "--workload shared-prefix --max-concurrency" in line
        assert "--num-prompts 8 --prefix-len 128" in line
    assert any("--prefix-cache hash" in line for line in lines)
    assert any("llama_cpp.server" in line for line in lines)
    assert not list(tmp_path.iterdir())  # nothing written


def test_presets_cover_the_claims() -> None:
    peers = _load()
    for runs in peers.PRESETS.values():
        keys = {(r.workload, r.concurrency) for r in runs}
        assert {("shared-prefix", 1), ("shared-prefix", 5), ("unique", 5)} <= keys
        assert ("identical", 8) in keys
        assert {w for w, _ in keys} >= {
            "trap-timestamp",
            "trap-unsorted-tools",
            "trap-short-prefix",
            "tools-sorted",
            "salted",
            "multi-turn",
            "agent",
            "prefix-repetition",
        }

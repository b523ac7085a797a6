"""The Responses store on its own: exact tokens back, per tenant, a TTL that each use renews,
a byte bound kept by evicting the least recently used, and everything still there when the
file is opened again."""

from __future__ import annotations

from pathlib import Path

from radixserve.server.response_store import ResponseStore, StoredResponse


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _response(i: int, tokens: int = 1000, tenant: str = "a") -> StoredResponse:
    return StoredResponse(id=f"resp_{i}", tenant=tenant, token_ids=list(range(i, i + tokens)),
                          prompt_len=tokens - 10, history_len=0, namespace=["tenant", "x", None],
                          input_items=[{"id": "msg_1", "type": "message"}],
                          body={"id": f"resp_{i}", "output": []})


def test_tokens_tenants_ttl_and_reopening(tmp_path: Path) -> None:
    clock = Clock()
    store = ResponseStore(tmp_path, 2**20, ttl_s=60.0, clock=clock)
    store.put(_response(1))
    got = store.get("resp_1", "a")
    assert got is not None and got.token_ids == list(range(1, 1001))
    assert got.namespace == ["tenant", "x", None] and got.input_items[0]["id"] == "msg_1"
    assert store.get("resp_1", "b") is None and not store.delete("resp_1", "b")
    clock.now += 50
    assert store.get("resp_1", "a") is not None  # renews: 60 s from now
    clock.now += 50
    assert store.get("resp_1", "a") is not None
    store.put(_response(2))
    store.close()
    reopened = ResponseStore(tmp_path, 2**20, ttl_s=60.0, clock=clock)
    assert reopened.bytes == store.bytes and len(reopened) == 2
    clock.now += 61
    assert reopened.get("resp_2", "a") is None  # expired
    reopened.put(_response(3))  # evicts the expired ones
    assert len(reopened) == 1 and reopened.delete("resp_3", "a") and reopened.bytes == 0


def test_the_bound_evicts_least_recently_used_first(tmp_path: Path) -> None:
    clock = Clock()
    one = len(_response(0).token_ids) * 4
    store = ResponseStore(tmp_path, max_bytes=int(one * 3.5), ttl_s=3600.0, clock=clock)
    for i in range(3):
        store.put(_response(i))
        clock.now += 1
    assert store.get("resp_0", "a") is not None  # now the most recently used
    clock.now += 1
    store.put(_response(3))
    assert store.bytes <= store.max_bytes and store.evicted == 1
    assert store.get("resp_1", "a") is None
    assert all(store.get(f"resp_{i}", "a") is not None for i in (0, 2, 3))

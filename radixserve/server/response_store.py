"""Stored Responses API responses, kept as the exact tokens the model saw and wrote, so that a
`previous_response_id` continues them without re-rendering the conversation.

One SQLite file on disk (it survives restarts; every process that opens it sees the same
responses), bounded in bytes, least recently used first out, each entry valid for a TTL that
every use renews. Nothing but a byte counter is held in memory.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

_SCHEMA = """
create table if not exists responses (
    id text primary key,
    tenant text not null,
    expires_at real not null,
    last_used real not null,
    size integer not null,
    tokens blob not null,
    record text not null
)"""


@dataclass(frozen=True)
class StoredResponse:
    """One response as a continuation needs it, and as GET and input_items return it."""

    id: str
    tenant: str  # who may see it: a hash of the API key that made it ("" on an open server)
    # The full token sequence: the rendered prompt (the stored history first) then the output.
    token_ids: list[int]
    prompt_len: int  # where the output starts in token_ids
    history_len: int  # where this response's own input starts (the previous response's end)
    namespace: Any  # the prefix-cache namespace, JSON-shaped (None, a salt, or a tenant list)
    # What the stored tokens were rendered with; a continuation must not contradict it.
    tools: list[dict[str, Any]] = field(default_factory=list)
    instructions: str | None = None
    input_items: list[dict[str, Any]] = field(default_factory=list)  # this request's own
    body: dict[str, Any] = field(default_factory=dict)  # the response object, as returned
    previous_response_id: str | None = None
    # The replica that generated it (behind --replicas), whose cache holds its tokens: the
    # router sends its continuations there. None: one engine, or unknown.
    replica: str | None = None


class ResponseStore:
    """Responses by id, on disk under `directory` (None: in memory, lost at exit)."""

    def __init__(self, directory: str | Path | None, max_bytes: int, ttl_s: float,
                 clock: Callable[[], float]) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock  # wall-clock seconds: expiry times outlive the process
        if directory is None:
            target = ":memory:"
        else:
            Path(directory).mkdir(parents=True, exist_ok=True)
            target = str(Path(directory) / "responses.sqlite3")
        self._lock = threading.Lock()
        # Several processes may share one store: wait for a writer rather than fail.
        self._db = sqlite3.connect(target, check_same_thread=False, isolation_level=None,
                                   timeout=30.0)
        self._db.execute("pragma journal_mode=wal")
        # No fsync per response: a crash of the process loses nothing, a power cut the last
        # few responses, and a store call stays well under a millisecond on the event loop.
        self._db.execute("pragma synchronous=normal")
        self._db.execute(_SCHEMA)
        self._db.execute("create index if not exists by_use on responses (last_used)")
        self._db.execute("create index if not exists by_expiry on responses (expires_at)")
        self.bytes = self._scalar("select coalesce(sum(size), 0) from responses")
        self.evicted = 0

    def _scalar(self, sql: str, *args: Any) -> int:
        return int(self._db.execute(sql, args).fetchone()[0])

    def __len__(self) -> int:
        with self._lock:
            return self._scalar("select count(*) from responses")

    def put(self, response: StoredResponse) -> None:
        """Stores `response` (replacing one of the same id), then evicts the least recently
        used until the store is within its bound again."""
        # Not asdict: it would deep-copy the token list only to drop it.
        record = {f.name: getattr(response, f.name) for f in fields(response)
                  if f.name != "token_ids"}
        text = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
        tokens = array("i", response.token_ids).tobytes()
        size = len(text.encode()) + len(tokens)
        now = self.clock()
        with self._lock:
            self._db.execute("begin immediate")
            old = self._db.execute("select size from responses where id = ?",
                                   (response.id,)).fetchone()
            self._db.execute("insert or replace into responses values (?, ?, ?, ?, ?, ?, ?)",
                             (response.id, response.tenant, now + self.ttl_s, now, size, tokens,
                              text))
            self.bytes += size - (old[0] if old else 0)
            self._evict(now)
            self._db.execute("commit")

    def _evict(self, now: float) -> None:
        expired = self._db.execute("select coalesce(sum(size), 0), count(*) from responses "
                                   "where expires_at <= ?", (now,)).fetchone()
        if expired[1]:
            self._db.execute("delete from responses where expires_at <= ?", (now,))
            self.bytes -= expired[0]
            self.evicted += expired[1]
        while self.bytes > self.max_bytes:
            rows = self._db.execute("select id, size from responses order by last_used "
                                    "limit 64").fetchall()
            if not rows:
                break
            for rid, size in rows:
                if self.bytes <= self.max_bytes:
                    break
                self._db.execute("delete from responses where id = ?", (rid,))
                self.bytes -= size
                self.evicted += 1

    def get(self, response_id: str, tenant: str) -> StoredResponse | None:
        """The response, if it exists, has not expired and belongs to `tenant`; a hit renews
        its TTL and makes it the most recently used."""
        now = self.clock()
        with self._lock:
            row = self._db.execute("select tenant, expires_at, tokens, record from responses "
                                   "where id = ?", (response_id,)).fetchone()
            if row is None or row[0] != tenant or row[1] <= now:
                return None
            self._db.execute("update responses set last_used = ?, expires_at = ? where id = ?",
                             (now, now + self.ttl_s, response_id))
        tokens = array("i")
        tokens.frombytes(row[2])
        return StoredResponse(token_ids=tokens.tolist(), **json.loads(row[3]))

    def delete(self, response_id: str, tenant: str) -> bool:
        """Deletes the tenant's response; False when there was none to delete."""
        with self._lock:
            row = self._db.execute("select size from responses where id = ? and tenant = ? "
                                   "and expires_at > ?",
                                   (response_id, tenant, self.clock())).fetchone()
            if row is None:
                return False
            self._db.execute("delete from responses where id = ?", (response_id,))
            self.bytes -= row[0]
            return True

    def close(self) -> None:
        with self._lock:
            self._db.close()

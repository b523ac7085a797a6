"""What a tier directory holds, read from names, sizes, headers and pin files (never
payloads), and the removals `radixserve cache clear` makes: the model of `radixserve cache`,
which prints nothing (kv_tier/cli.py renders it)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from radixserve.kv_tier.entry import EntryError, EntryHeader, read_header
from radixserve.kv_tier.store import STALE_TEMP_S, list_dir


@dataclass(frozen=True)
class EntryFile:
    """One .kv file as the scan found it."""

    path: str
    size: int
    header: EntryHeader | None  # None: a bad entry (no readable header, or another's)
    pin_path: str | None
    pinned_until: float | None  # wall clock; None: no pin file, or one holding no time


@dataclass(frozen=True)
class LooseFile:
    """A pin file with no entry beside it, or a temporary file."""

    path: str
    mtime: float
    pinned_until: float | None = None  # pin files only


@dataclass
class FingerprintDir:
    name: str
    path: str
    described: dict[str, Any] | None  # fingerprint.json; None when missing or unreadable
    entries: list[EntryFile] = field(default_factory=list)
    stray_pins: list[LooseFile] = field(default_factory=list)
    temps: list[LooseFile] = field(default_factory=list)


@dataclass(frozen=True)
class ClearRule:
    namespace: str | None
    keep_pinned: bool
    expired_only: bool


@dataclass
class Removed:
    """What `clear` removed from one fingerprint directory."""

    fingerprint: str
    entries: int = 0
    bad_entries: int = 0
    pin_files: int = 0  # removed on their own: expired pins, or pins with no entry
    temp_files: int = 0
    bytes: int = 0
    left: int = 0  # entries (good and bad) still there
    failures: list[str] = field(default_factory=list)


def scan_tier(layout: str) -> list[FingerprintDir]:
    """Every fingerprint directory under `layout`, by name; none when it does not exist."""
    return [_scan_fingerprint(item.name, item.path)
            for item in sorted(list_dir(layout), key=lambda item: item.name) if item.is_dir()]


def _scan_fingerprint(name: str, path: str) -> FingerprintDir:
    found = FingerprintDir(name, path, _read_described(os.path.join(path, "fingerprint.json")))
    kv: dict[str, tuple[str, int]] = {}
    pins: dict[str, LooseFile] = {}
    subdirs = [item.path for item in list_dir(path) if item.is_dir() and len(item.name) == 2]
    for directory in [path, *subdirs]:
        for item in list_dir(directory):
            try:
                stat = item.stat()
            except FileNotFoundError:
                continue  # removed meanwhile (a server evicting): not there
            if item.name.endswith(".tmp"):
                found.temps.append(LooseFile(item.path, stat.st_mtime))
            elif directory == path:
                continue  # fingerprint.json
            elif item.name.endswith(".kv"):
                kv[item.name[: -len(".kv")]] = (item.path, stat.st_size)
            elif item.name.endswith(".pin"):
                pins[item.name[: -len(".pin")]] = LooseFile(item.path, stat.st_mtime,
                                                            _read_pin(item.path))
    for key, (kv_path, size) in sorted(kv.items()):
        pin = pins.pop(key, None)
        try:
            header = _read_own_header(kv_path, key, name)
        except FileNotFoundError:
            continue
        found.entries.append(EntryFile(kv_path, size, header, pin.path if pin else None,
                                       pin.pinned_until if pin else None))
    found.stray_pins = sorted(pins.values(), key=lambda pin: pin.path)
    return found


def _read_described(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            described = json.load(f)
    except (OSError, ValueError):
        return None
    return described if isinstance(described, dict) else None


def _read_pin(path: str) -> float | None:
    try:
        with open(path) as f:
            until = float(f.read())
    except (OSError, ValueError):
        return None
    return until if math.isfinite(until) else None


def _read_own_header(path: str, key: str, fingerprint: str) -> EntryHeader | None:
    """The entry's header if it is readable and names this file's block and model (a server
    deletes an entry that does not on its first read of it). Raises FileNotFoundError when
    the file vanished since the listing."""
    try:
        header = read_header(path)
    except FileNotFoundError:
        raise
    except (EntryError, OSError):
        return None
    return header if header.key == key and header.fingerprint == fingerprint else None


def clear_fingerprint(fp: FingerprintDir, rule: ClearRule, now: float) -> Removed:
    """Removes what `rule` selects from one fingerprint directory (see the clear's --help)."""
    removed = Removed(fp.name)
    unfiltered = rule.namespace is None
    for entry in fp.entries:
        if not unfiltered and (entry.header is None or entry.header.namespace != rule.namespace):
            removed.left += 1
            continue
        pin_expired = entry.pinned_until is not None and entry.pinned_until <= now
        if rule.expired_only:
            removed.left += 1
            if entry.pin_path and pin_expired and _remove(entry.pin_path, removed):
                removed.pin_files += 1
            continue
        pin_live = entry.pinned_until is not None and not pin_expired
        if rule.keep_pinned and pin_live and entry.header is not None:
            removed.left += 1
            continue
        if _remove(entry.path, removed):
            if entry.header is None:
                removed.bad_entries += 1
            else:
                removed.entries += 1
        if entry.pin_path:
            _remove(entry.pin_path, removed)
    if unfiltered:
        for pin in fp.stray_pins:
            stale = pin.pinned_until is None or pin.pinned_until <= now
            if (stale or not rule.expired_only) and _remove(pin.path, removed):
                removed.pin_files += 1
        if not rule.expired_only:
            for temp in fp.temps:
                if is_stale(temp, now) and _remove(temp.path, removed):
                    removed.temp_files += 1
    return removed


def _remove(path: str, removed: Removed) -> bool:
    """Deletes a file, adding its size to `removed`; False when it was already gone (a server
    evicted it meanwhile) or could not be deleted (noted in `removed.failures`)."""
    try:
        size = os.stat(path).st_size
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        removed.failures.append(f"cannot remove {path}: {exc.strerror}")
        return False
    removed.bytes += size
    return True


def is_stale(temp: LooseFile, now: float) -> bool:
    return now - temp.mtime > STALE_TEMP_S

"""`radixserve cache`: inspects and clears a disk KV tier directory (the --kv-offload-dir).

The only module of the tier that prints. Both verbs read the same scan: file names, sizes,
entry headers and pin files, never payloads. Exit status 0 on success; 1 when `clear` matched
no fingerprint directory or could not remove a file; 2 when DIR is missing or not a directory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from radixserve.kv_tier.inventory import (
    ClearRule,
    FingerprintDir,
    Removed,
    clear_fingerprint,
    is_stale,
    scan_tier,
)
from radixserve.kv_tier.store import LAYOUT_DIR

EXIT_OK, EXIT_INCOMPLETE, EXIT_USAGE = 0, 1, 2

_EPILOG = f"""\
DIR is the directory given to `radixserve serve --kv-offload-dir`; entries live in
DIR/{LAYOUT_DIR}/<fingerprint>/<2 hex>/<key>.kv, one directory per model fingerprint.
Clearing while a server uses DIR is safe: a server treats an entry that vanished as a miss
and computes the prefix again.

examples:
  radixserve cache info /var/cache/kv
  radixserve cache info /var/cache/kv --json
  radixserve cache clear /var/cache/kv --fingerprint 3f2a --keep-pinned
  radixserve cache clear /var/cache/kv --namespace '"salt-a"'
  radixserve cache clear /var/cache/kv --expired-only
"""

_INFO_DESCRIPTION = """\
Prints, per fingerprint directory: the model it was computed for (fingerprint.json), its
entries with their bytes and tokens, entries and tokens per tenant namespace, pins with the
time they have left (or 'expired'), bad entries (unreadable header, or one naming another
block or model), and temporary files (stale: older than 10 minutes, a crashed write)."""

_CLEAR_DESCRIPTION = """\
Removes tier entries (each .kv file with its .pin file) and prints what it removed per
fingerprint. Without filters it removes every entry of every fingerprint, plus bad entries
(unreadable header, or one naming another block or model), pin files whose entry is gone,
and temporary files older than 10 minutes (crashed writes). Directories and fingerprint.json
stay: a server running on DIR keeps writing there."""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "cache", help="inspect and clear a disk KV tier directory",
        description=__doc__.split("\n\n")[0], epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="cache_command", required=True)

    info = verbs.add_parser(
        "info", help="what the tier holds, per model fingerprint",
        description=_INFO_DESCRIPTION,
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    info.add_argument("dir", metavar="DIR", help="the tier directory (--kv-offload-dir)")
    info.add_argument("--json", action="store_true",
                      help="print one JSON document with the same figures (every pinned entry "
                           "listed on its own), for scripts")
    info.set_defaults(func=run_info)

    clear = verbs.add_parser(
        "clear", help="remove entries (all, or by fingerprint, namespace, pin)",
        description=_CLEAR_DESCRIPTION, epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    clear.add_argument("dir", metavar="DIR", help="the tier directory (--kv-offload-dir)")
    clear.add_argument("--fingerprint", metavar="PREFIX", default=None,
                       help="only fingerprint directories whose name starts with PREFIX (hex, "
                            "as `cache info` prints it); exit status 1 if none does")
    clear.add_argument("--namespace", metavar="TEXT", default=None,
                       help="only entries whose header namespace is exactly TEXT, as `cache "
                            "info` prints it: '' (the shared namespace), '\"salt-a\"' (quotes "
                            "included), or '[\"tenant\",\"<hash>\",null]'; bad entries, stray "
                            "pins and temporary files are then left alone")
    pins = clear.add_mutually_exclusive_group()
    pins.add_argument("--keep-pinned", action="store_true",
                      help="leave entries whose pin has not expired (with their pin files); "
                           "entries with an expired pin are removed, and bad entries go "
                           "whatever their pin")
    pins.add_argument("--expired-only", action="store_true",
                      help="remove no entry: only pin files whose expiry has passed, so those "
                           "entries become ordinary LRU entries again (bad entries and "
                           "temporary files are left alone)")
    clear.set_defaults(func=run_clear)


def run_info(args: argparse.Namespace) -> int:
    layout = _layout_dir(args.dir)
    if layout is None:
        return EXIT_USAGE
    now = time.time()
    report = [_describe(fp, now) for fp in scan_tier(layout)]
    if args.json:
        print(json.dumps({"dir": layout, "time": now, "totals": _totals(report),
                          "fingerprints": report}, indent=2))
    else:
        sys.stdout.write(_render_info(layout, report, now))
    return EXIT_OK


def run_clear(args: argparse.Namespace) -> int:
    layout = _layout_dir(args.dir)
    if layout is None:
        return EXIT_USAGE
    found = scan_tier(layout)
    prefix = (args.fingerprint or "").lower()
    chosen = [fp for fp in found if fp.name.startswith(prefix)]
    if not chosen:
        where = f" whose name starts with {args.fingerprint!r}" if args.fingerprint else ""
        print(f"radixserve cache: {layout}: no fingerprint directory{where}; nothing removed",
              file=sys.stderr if args.fingerprint else sys.stdout)
        return EXIT_INCOMPLETE if args.fingerprint else EXIT_OK
    rule = ClearRule(args.namespace, args.keep_pinned, args.expired_only)
    now = time.time()
    results = [clear_fingerprint(fp, rule, now) for fp in chosen]
    sys.stdout.write(_render_clear(layout, rule, results))
    failures = [message for result in results for message in result.failures]
    for message in failures:
        print(f"radixserve cache: {message}", file=sys.stderr)
    return EXIT_INCOMPLETE if failures else EXIT_OK


# ----- the scan -----


def _layout_dir(path: str) -> str | None:
    """DIR/radixserve-kv-v1 (DIR may also name that directory itself); None, said on stderr,
    when DIR is not a directory."""
    if not os.path.isdir(path):
        problem = "not a directory" if os.path.exists(path) else "no such directory"
        print(f"radixserve cache: {path}: {problem}", file=sys.stderr)
        return None
    path = os.path.abspath(path)
    return path if os.path.basename(path) == LAYOUT_DIR else os.path.join(path, LAYOUT_DIR)


# ----- info -----


def _describe(fp: FingerprintDir, now: float) -> dict[str, Any]:
    good = [(entry, entry.header) for entry in fp.entries if entry.header is not None]
    bad = [entry for entry in fp.entries if entry.header is None]
    namespaces: dict[str, dict[str, int]] = {}
    for entry, header in good:
        figures = namespaces.setdefault(header.namespace, {"entries": 0, "tokens": 0, "bytes": 0})
        figures["entries"] += 1
        figures["tokens"] += len(header.tokens)
        figures["bytes"] += entry.size
    pins = [{"key": header.key, "namespace": header.namespace, "tokens": len(header.tokens),
             "until": until, "seconds_left": max(0.0, until - now), "expired": until <= now}
            for entry, header in good if (until := entry.pinned_until) is not None]
    return {
        "name": fp.name,
        "model": fp.described,
        "entries": len(good),
        "bytes": sum(entry.size for entry, _ in good),
        "tokens": sum(len(header.tokens) for _, header in good),
        "namespaces": dict(sorted(namespaces.items())),
        "pins": sorted(pins, key=lambda pin: (pin["until"], pin["namespace"], pin["key"])),
        "bad_entries": len(bad),
        "bad_bytes": sum(entry.size for entry in bad),
        "stray_pin_files": len(fp.stray_pins),
        "temporary_files": len(fp.temps),
        "stale_temporary_files": sum(1 for temp in fp.temps if is_stale(temp, now)),
    }


def _totals(report: list[dict[str, Any]]) -> dict[str, int]:
    return {name: sum(fp[name] for fp in report)
            for name in ("entries", "bytes", "tokens", "bad_entries")}


def _render_info(layout: str, report: list[dict[str, Any]], now: float) -> str:
    if not report:
        where = layout if os.path.isdir(layout) else os.path.dirname(layout)
        what = "no fingerprint directory" if os.path.isdir(layout) else f"no {LAYOUT_DIR}"
        return f"{where}: empty ({what}; nothing cached)\n"
    totals = _totals(report)
    lines = [f"{layout}: {_plural(len(report), 'fingerprint')}, "
             f"{_plural(totals['entries'], 'entry', 'entries')}, "
             f"{_human_bytes(totals['bytes'])}, {_plural(totals['tokens'], 'token')}"]
    for fp in report:
        lines += ["", f"fingerprint {fp['name']}"]
        lines += [f"  {label:<14}{value}" for label, value in _model_lines(fp["model"])]
        lines.append(f"  {'entries':<14}{fp['entries']} ({_human_bytes(fp['bytes'])}, "
                     f"{_plural(fp['tokens'], 'token')})")
        lines.append(f"  {'bad entries':<14}{fp['bad_entries']}"
                     + (f" ({_human_bytes(fp['bad_bytes'])})" if fp["bad_entries"] else ""))
        if fp["stray_pin_files"]:
            lines.append(f"  {'stray pins':<14}{fp['stray_pin_files']} (pin files with no entry)")
        lines.append(f"  {'temp files':<14}{fp['temporary_files']}"
                     + (f" ({fp['stale_temporary_files']} stale: older than 10 min)"
                        if fp["temporary_files"] else ""))
        namespaces = [[text, str(n["entries"]), str(n["tokens"]), _human_bytes(n["bytes"])]
                      for text, n in fp["namespaces"].items()]
        lines += _section("namespaces", ["namespace", "entries", "tokens", "bytes"],
                          namespaces, "<>>>")
        lines += _section("pins", ["namespace", "entries", "tokens", "expires"],
                          _pin_rows(fp["pins"], now), "<>><")
    return "\n".join(lines) + "\n"


def _model_lines(model: dict[str, Any] | None) -> list[tuple[str, str]]:
    if model is None:
        return [("model", "unknown (fingerprint.json missing or unreadable)")]
    get = model.get
    return [
        ("weights", str(get("weights", "?"))[:12]),
        ("dtype", str(get("dtype", "?"))),
        ("quantization", str(get("quantization", "?"))),
        ("projections", str(get("projections", "?"))),
        ("attention", str(get("attention", "?"))),
        ("block tokens", str(get("block_tokens", "?"))),
        ("shape", f"layers {get('num_layers', '?')}, kv heads {get('num_kv_heads', '?')}, "
                  f"head dim {get('head_dim', '?')}, page size {get('page_size', '?')}"),
        ("software", str(get("software") or "?")),
    ]


def _pin_rows(pins: list[dict[str, Any]], now: float) -> list[list[str]]:
    """One row per (namespace, expiry): the blocks of one pinned prefix share their expiry."""
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for pin in pins:
        groups.setdefault((pin["namespace"], pin["until"]), []).append(pin)
    rows = []
    for (namespace, until), group in groups.items():
        expires = (f"expired {_duration(now - until)} ago" if until <= now
                   else f"in {_duration(until - now)}")
        rows.append([namespace, str(len(group)), str(sum(pin["tokens"] for pin in group)),
                     expires])
    return rows


def _section(title: str, header: list[str], rows: list[list[str]], align: str) -> list[str]:
    if not rows:
        return [f"  {title:<14}none"]
    return [f"  {title}:", *_table([header, *rows], align, indent=4)]


# ----- clear -----


def _render_clear(layout: str, rule: ClearRule, results: list[Removed]) -> str:
    header = ["fingerprint", "entries", "bad", "pins", "temp files", "bytes", "left"]
    rows = [[r.fingerprint[:12], str(r.entries), str(r.bad_entries), str(r.pin_files),
             str(r.temp_files), _human_bytes(r.bytes), str(r.left)] for r in results]
    if len(results) > 1:
        rows.append(["total", *(str(sum(getattr(r, name) for r in results))
                                for name in ("entries", "bad_entries", "pin_files", "temp_files")),
                     _human_bytes(sum(r.bytes for r in results)),
                     str(sum(r.left for r in results))])
    note = ("pins: pin files removed on their own (expired, or with no entry); "
            "left: entries still there")
    scope = [f"namespace {rule.namespace}"] if rule.namespace is not None else []
    scope += ["live pins kept"] if rule.keep_pinned else []
    scope += ["expired pin files only"] if rule.expired_only else []
    title = f"removed from {layout}" + (f" ({'; '.join(scope)})" if scope else "")
    return "\n".join([f"{title}:", *_table([header, *rows], "<>>>>>>"), note, ""])


# ----- formatting -----


def _table(rows: list[list[str]], align: str, indent: int = 0) -> list[str]:
    """Rows as aligned columns, two spaces apart; `align` has one '<' or '>' per column."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(align))]
    cells = (zip(row, align, widths, strict=True) for row in rows)
    return [" " * indent + "  ".join(f"{cell:{a}{w}}" for cell, a, w in line).rstrip()
            for line in cells]


def _human_bytes(n: int) -> str:
    if n < 1000:
        return f"{n} B"
    value = float(n)
    for unit in ("kB", "MB", "GB", "TB"):
        value /= 1000
        if value < 1000 or unit == "TB":
            break
    return f"{value:.1f} {unit}"


def _duration(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


def _plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"

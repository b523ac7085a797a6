"""`radixserve lint`: finds prompt-cache busters in request logs and simulates vendor costs.

The only module of the linter that prints; exit status 0 when clean, 1 when findings exceed
--fail-threshold (for CI), 2 on unusable input (no such file, bad price file, no model).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from radixserve.provider_caching.prices import MissingPrice, default_prices, load_prices
from radixserve.provider_caching.profiles import PROFILES, VENDORS, get_profile

EXIT_CLEAN, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2

_EPILOG = """\
log lines: a request body per line (OpenAI chat completions or Anthropic messages, detected
per line), optionally with a "timestamp" key; or {"timestamp": ..., "body": {...}} with
optional "format" and "output_tokens". Timestamps: Unix seconds/milliseconds or ISO 8601.
"""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "lint", help="find prompt-cache busters in request logs and simulate vendor costs",
        description=__doc__.split("\n\n")[0], epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", metavar="LOG",
                        help="JSON Lines log files, or directories of *.jsonl files")
    parser.add_argument("--model", default=None,
                        help="model whose tokenizer counts tokens: a .gguf file or HF directory "
                             "(default: the default model, SmolLM2-135M-Instruct)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--fail-threshold", type=int, default=0, metavar="N",
                        help="exit with status 1 when there are more than N findings (default 0)")
    parser.add_argument("--simulate", choices=VENDORS, default=None,
                        help="replay the log under this vendor's caching rules and price it, "
                             "as logged and with every fix applied")
    parser.add_argument("--prices", default=None, metavar="FILE",
                        help='JSON price overrides: {"anthropic-1024": {"input": 3, "output": 15, '
                             '"cache_write_5m": 1.25, "cache_write_1h": 2, "cache_read": 0.1}}; '
                             "keys are profile names or model-id prefixes, $ per million tokens")
    parser.add_argument("--profile", default=None, choices=[p.name for p in PROFILES],
                        help="model profile for minimums and prices (default: from each "
                             "request's model id)")
    parser.add_argument("--first-token-s", type=float, default=1.0, metavar="S",
                        help="seconds from a request's start to its first token: its cache "
                             "writes are readable only after that (fan-out window; default 1.0)")
    parser.add_argument("--colour", "--color", choices=("auto", "always", "never"),
                        default="auto", help="colour the report (auto: only on a terminal)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from radixserve.lint.analysis import LintOptions, lint_log
    from radixserve.lint.logs import read_logs
    from radixserve.lint.report import render_text, to_json

    try:
        contents = read_logs(args.paths)
        prices = load_prices(args.prices) if args.prices else default_prices()
        if args.profile:
            get_profile(args.profile)
        tokenizer = _load_tokenizer(args.model)
    except (OSError, ValueError, KeyError) as exc:
        print(f"radixserve lint: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not contents.files:
        print("radixserve lint: no .jsonl files found", file=sys.stderr)
        return EXIT_USAGE
    options = LintOptions(simulate=args.simulate, profile=args.profile,
                          first_token_s=args.first_token_s, prices=prices)
    try:
        report = lint_log(contents, tokenizer, options)
    except MissingPrice as exc:
        print(f"radixserve lint: {exc.args[0]}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(to_json(report), indent=2, ensure_ascii=False))
    else:
        colour = args.colour == "always" or (args.colour == "auto" and sys.stdout.isatty())
        sys.stdout.write(render_text(report, colour))
    return EXIT_FINDINGS if len(report.findings) > args.fail_threshold else EXIT_CLEAN


def _load_tokenizer(model: str | None) -> Any:
    from radixserve.model.default_model import ModelFetchError, resolve_model_path
    from radixserve.model.loader import load_tokenizer

    try:
        return load_tokenizer(resolve_model_path(model))
    except ModelFetchError as exc:
        raise ValueError(str(exc)) from None

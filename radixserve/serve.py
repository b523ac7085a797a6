"""The launch layer, `radixserve serve`: parses the flags, builds the server settings and the
engine config, and starts either the single server (the model loaded here, the engine on its
own thread, the app under uvicorn) or replicas on Ray Serve (`replicas.launch`).

SIGTERM (or Ctrl-C) drains: readiness turns 503 and new requests get 503 + Retry-After while the
server keeps listening, in-flight ones get --shutdown-timeout seconds to finish and are then
aborted (streams end with an error event), the engine stops, the disk tier flushes, and the
process exits 0. A watchdog (`server.watchdog`) exits non-zero when the engine dies or sticks.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, TypeVar

from radixserve.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    MATMUL_BACKEND_ALIASES,
    MATMUL_BACKENDS,
    PREFILL_ATTENTION_BACKENDS,
    PREFIX_CACHE_MODES,
    QUANTIZATIONS,
    SCHEDULE_POLICIES,
    SPECULATIVE_METHODS,
    SWA_MEMORY_MODES,
    EngineConfig,
)
from radixserve.home import cache_home
from radixserve.replicas.launch import add_flags as add_replica_flags
from radixserve.replicas.launch import check_flags as check_replica_flags
from radixserve.replicas.launch import check_single, serve_replicas
from radixserve.server.reasoning import REASONING_PARSERS
from radixserve.server.settings import (
    CACHE_ACCOUNTING_MODES,
    DEFAULT_MODEL_NAME,
    MAX_TOKENS_POLICIES,
    METRICS_COMPAT_MODES,
    ServerSettings,
)
from radixserve.server.tool_calls.parsers import PARSERS

if TYPE_CHECKING:  # imported when serving only, so that `radixserve --help` stays fast
    from fastapi import FastAPI

    from radixserve.engine.async_engine import AsyncEngine

logger = logging.getLogger("radixserve.server")

API_KEY_ENV = "RADIXSERVE_API_KEY"
SettingsT = TypeVar("SettingsT")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless it has none worth showing (unset, or a plain switch)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "serve",
        help="serve a model over OpenAI- and Anthropic-compatible HTTP APIs",
        description="Serve a model over HTTP: POST /v1/chat/completions, POST /v1/completions, "
                    "GET /v1/models, POST /v1/messages, POST /v1/messages/count_tokens, "
                    "GET /health, GET /metrics (Prometheus; both answer HEAD too).",
        formatter_class=_HelpFormatter,
    )
    _model_flags(p.add_argument_group("model"))
    _cache_flags(p.add_argument_group("KV cache and scheduling"))
    _tier_flags(p.add_argument_group("disk KV tier (off unless --kv-offload-dir is given)"))
    _events_flags(p.add_argument_group("KV cache events (for an external router: llm-d, Dynamo)"))
    add_replica_flags(p.add_argument_group(
        "replicas on Ray Serve (off unless --replicas is given; needs radixserve[ray])"))
    _grammar_flags(p.add_argument_group("structured output"))
    http = p.add_argument_group("HTTP")
    _http_flags(http)
    _accounting_flags(p.add_argument_group("prompt-cache accounting and cost"))
    _responses_flags(p.add_argument_group("Responses API store (previous_response_id)"))
    _agent_flags(p.add_argument_group("agent clients (Claude Code; docs/claude-code.md)"))
    http.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="log verbosity")
    http.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                      help="log one line per HTTP request")
    p.set_defaults(func=serve)


def _model_flags(model: argparse._ArgumentGroup) -> None:
    model.add_argument("--model", default=None,
                       help="an HF model directory or a .gguf file; unset: the default model "
                            "(SmolLM2-135M-Instruct, fetched on first use)")
    model.add_argument("--served-model-name", action="append", default=None, metavar="NAME",
                       help="name clients send as `model` (repeatable; the first is listed "
                            "first); unset: --model as given, or SmolLM2-135M-Instruct")
    model.add_argument("--dtype", choices=DTYPES, default="auto",
                       help="weights and KV dtype; auto: bfloat16 on GPUs and CPUs with native "
                            "bf16, else float32")
    model.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    model.add_argument("--max-model-len", type=int, default=None,
                       help="context length limit; unset: the model's own")
    model.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                       help="decode attention: kernel (C++, reads the paged KV pool in place; "
                            "CPU, float32/bfloat16), torch (PyTorch ops, any device), auto "
                            "(kernel where it applies and compiles)")
    model.add_argument("--prefill-attention-backend", choices=PREFILL_ATTENTION_BACKENDS,
                       default="auto",
                       help="prefill attention: kernel (the decode kernel row by row, "
                            "batch invariant: cache on == off exactly; CPU, float32/bfloat16), "
                            "blocked (blocked causal attention on bfloat16 matmuls; CPU, "
                            "bfloat16/float16), sdpa (PyTorch's SDPA, any device), auto (the "
                            "first that applies)")
    model.add_argument("--matmul-backend", choices=[*MATMUL_BACKENDS, *MATMUL_BACKEND_ALIASES],
                       default="auto",
                       help="projections: kernel (C++ bfloat16 matmul for steps of at most 48 "
                            "tokens, CPUs with AVX512-BF16), float-panels (C++ float32 matmul "
                            "on 16-row weight panels, any row count, CPUs with AVX2 or AVX-512; "
                            "skinny-float is its former name, still accepted), widen (half-precision weights "
                            "computed in float32 from 16 rows up, CPUs without native "
                            "bfloat16), torch (nn.Linear), auto (the first that applies)")
    model.add_argument("--quantization", choices=QUANTIZATIONS,
                       default=EngineConfig.quantization,
                       help="auto: GGUF matrices in Q8_0/Q4_0/Q4_1/Q4_K/Q6_K (and Q5_0, as Q8_0) stay quantized and run on "
                            "our C++ kernel (CPU; the default); none: dequantize every tensor at load "
                            "(the reference path); int8/int4: also quantize float weights at "
                            "load (to Q8_0/Q4_1)")
    model.add_argument("--chat-template", default=None, metavar="PATH",
                       help="a Jinja chat template file used instead of the model's own")
    model.add_argument("--num-threads", type=int, default=None,
                       help="torch CPU threads; unset: torch's default")
    model.add_argument("--seed", type=int, default=0,
                       help="seeds sampling for requests that send no seed of their own")


def _cache_flags(cache: argparse._ArgumentGroup) -> None:
    cache.add_argument("--prefix-cache", choices=PREFIX_CACHE_MODES, default="radix",
                       help="radix: token-granular radix tree; hash: vLLM-style block hashes; "
                            "off: no reuse")
    cache.add_argument("--page-size", type=int, default=1,
                       help="tokens per KV page (1: reuse at any token boundary)")
    cache.add_argument("--kv-cache-tokens", type=int, default=None,
                       help="KV pool size in tokens; unset: sized by --kv-cache-memory-gb")
    cache.add_argument("--kv-cache-memory-gb", type=float, default=1.0,
                       help="KV pool size in GiB when --kv-cache-tokens is unset")
    cache.add_argument("--swa-memory", choices=SWA_MEMORY_MODES, default=EngineConfig.swa_memory,
                       help="sliding-window layers' KV: full keeps the whole context in every "
                            "layer; window keeps only the window (and a window at each cached "
                            "chunk or prompt end) in a slot space of their own")
    cache.add_argument("--swa-pool-ratio", type=float, default=EngineConfig.swa_pool_ratio,
                       help="with --swa-memory window: the window group's pool in tokens as a "
                            "fraction of the full-attention layers'")
    cache.add_argument("--max-num-seqs", type=int, default=64,
                       help="most sequences in one running batch")
    cache.add_argument("--max-num-batched-tokens", type=int, default=2048,
                       help="most tokens computed in one step (longer prefills are chunked)")
    cache.add_argument("--schedule-policy", choices=SCHEDULE_POLICIES, default="fcfs",
                       help="fcfs: arrival order; lpm: longest cached prefix first, with aging")
    cache.add_argument("--short-prefill-tokens", type=int,
                       default=EngineConfig.short_prefill_tokens,
                       help="a request with at most this many uncached prompt tokens is "
                            "prefilled ahead of longer prompts (within half of each step's "
                            "token budget), so that it is not queued behind their prefill; "
                            "0: arrival order")
    cache.add_argument("--max-pinned-fraction", type=float, default=0.5,
                       help="most of the KV pool that cache_control TTL pins may hold; beyond "
                            "it the oldest pin yields first")
    cache.add_argument("--speculative", choices=SPECULATIVE_METHODS,
                       default=EngineConfig.speculative,
                       help="speculative decoding without a draft model: ngram drafts from "
                            "the request's own prompt and output, suffix also from earlier "
                            "requests of its namespace (cache_salt), auto as suffix where the "
                            "step gains by the cost model (forward times measured at start-up, "
                            "the step's other work measured as it runs) and the request's "
                            "acceptance so far (rarely when many rows run); "
                            "greedy output unchanged, sampled output's distribution unchanged, "
                            "constrained requests never speculate. A request may override it "
                            "(extra_body speculative, num_speculative_tokens)")
    cache.add_argument("--num-speculative-tokens", type=int,
                       default=EngineConfig.num_speculative_tokens,
                       help="most draft tokens verified per request and step")
    cache.add_argument("--debug-invariants", action="store_true",
                       help="check KV slot accounting whenever the engine is idle (slow; tests)")


def _tier_flags(tier: argparse._ArgumentGroup) -> None:
    tier.add_argument("--kv-offload-dir", default=None, metavar="DIR",
                      help="keep prefixes' KV in files under DIR: every block a request "
                           "computes is written there in the background and read back when a "
                           "later prompt needs it beyond what the KV pool holds, across "
                           "evictions and restarts (cache_control pins keep their expiry); "
                           "inspect or clear it with `radixserve cache`")
    tier.add_argument("--kv-offload-gb", type=float, default=EngineConfig.kv_offload_gb,
                      help="most disk space (GB) the tier uses; least recently used blocks "
                           "go first, pinned ones last")
    tier.add_argument("--kv-offload-block-tokens", type=int,
                      default=EngineConfig.kv_offload_block_tokens,
                      help="tokens per tier block (one file); a multiple of --page-size")
    tier.add_argument("--kv-offload-queue-mb", type=float,
                      default=EngineConfig.kv_offload_queue_mb,
                      help="most KV (MB) waiting to be written; writes beyond it are dropped "
                           "and counted (pinned prefixes are always written)")


def _events_flags(events: argparse._ArgumentGroup) -> None:
    events.add_argument("--kv-events-endpoint", default=None, metavar="ZMQ_ENDPOINT",
                        help="publish what the radix prefix cache stores and evicts (vLLM's "
                             "KV event schema, msgpack over a ZMQ PUB socket bound here, e.g. "
                             "tcp://*:5557; port 0 picks a free one); off when unset; needs "
                             "--prefix-cache radix")
    events.add_argument("--kv-events-replay-endpoint", default=None, metavar="ZMQ_ENDPOINT",
                        help="ZMQ ROUTER socket bound here answers replay requests: a "
                             "subscriber sends a start sequence number and gets the buffered "
                             f"batches from it on (the last "
                             f"{EngineConfig.kv_events_buffer_steps:,}), e.g. tcp://*:5558")
    events.add_argument("--kv-events-block-size", type=int, metavar="TOKENS",
                        default=EngineConfig.kv_events_block_size,
                        help="tokens per hashed block in the events; a multiple of --page-size")
    # SUPPRESS: unset leaves EngineConfig's empty topic, without a blank "(default: )".
    events.add_argument("--kv-events-topic", default=argparse.SUPPRESS, metavar="TOPIC",
                        help="ZMQ topic (first frame) of every event message, which "
                             "subscribers filter on by prefix; unset: empty")


def _http_flags(http: argparse._ArgumentGroup) -> None:
    http.add_argument("--host", default="127.0.0.1", help="address to listen on")
    http.add_argument("--port", type=int, default=8000, help="port to listen on")
    http.add_argument("--api-key", action="append", default=None, metavar="KEY",
                      help="accept only requests bearing this key (repeatable; /health and "
                           f"/metrics stay open); ${API_KEY_ENV} adds one without showing it "
                           "in the process list")
    http.add_argument("--isolate-tenants", action="store_true",
                      help="give each API key its own prefix-cache namespace, whatever "
                           "cache_salt a client sends (needs --api-key)")
    _overload_flags(http)
    http.add_argument("--max-request-bytes", type=int, default=32 * 2**20,
                      help="largest request body; larger ones get 413")
    http.add_argument("--shutdown-timeout", type=float, default=30.0,
                      help="seconds in-flight requests get to finish after SIGTERM before "
                           "they are aborted")
    http.add_argument("--tool-call-parser", choices=PARSERS, default=None,
                      help="how tool calls are read from the model's output; default: chosen "
                           "from the chat template (hermes where it has no tool format)")
    http.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default="auto",
                      help="how reasoning is read from replies (returned as reasoning_content "
                           "/ thinking blocks): think (<think>...</think>), none, auto (the "
                           "model family's: think for Qwen3, Qwen3-MoE and SmolLM3, or where "
                           "the chat template writes think tags)")
    http.add_argument("--metrics-compat", choices=METRICS_COMPAT_MODES, default=None,
                      help="vllm: /metrics also exports `vllm:`-named twins (vLLM 0.11's names "
                           "and labels) of the metrics vLLM has, for aiperf and vLLM's Grafana "
                           "boards")


def _grammar_flags(grammar: argparse._ArgumentGroup) -> None:
    grammar.add_argument("--grammar-int64-integers", action=argparse.BooleanOptionalAction,
                         default=EngineConfig.grammar_int64_integers,
                         help="give JSON-schema integers without a range int64's range, so a "
                              "degenerate run of digits ends")
    grammar.add_argument("--grammar-max-number-chars", type=int, metavar="CHARS",
                         default=EngineConfig.grammar_max_number_chars,
                         help="longest JSON number text under a JSON constraint (24 holds "
                              "every float64 in shortest form); 0: unbounded")
    grammar.add_argument("--grammar-max-whitespace-run", type=int, metavar="CHARS",
                         default=EngineConfig.grammar_max_whitespace_run,
                         help="longest run of whitespace any constraint lets the model write, "
                              "unless the grammar requires more; 0: unbounded")
    grammar.add_argument("--grammar-jump-forward", action=argparse.BooleanOptionalAction,
                         default=EngineConfig.grammar_jump_forward,
                         help="take the text a grammar forces (a forced call's name, a "
                              "schema's keys) as tokens at once and compute them in one "
                              "chunk, instead of one decode step per token")


def _overload_flags(http: argparse._ArgumentGroup) -> None:
    d = ServerSettings()
    http.add_argument("--max-waiting", type=int, default=d.max_waiting,
                      help="requests accepted but without a first token yet; beyond it, 429 "
                           "(Anthropic routes: 529) with retry-after and retry-after-ms")
    http.add_argument("--max-queued-tokens", type=int, default=d.max_queued_tokens,
                      help="prompt tokens waiting for their prefill (less their expected cache "
                           "hits, estimated from the body's length until tokenized); beyond it, "
                           "429/529")
    http.add_argument("--max-queue-wait", type=float, default=d.max_queue_wait_s,
                      metavar="SECONDS",
                      help="the longest estimated queue wait (queued uncached prompt tokens over "
                           "the measured prefill rate) a new request may face; beyond it, "
                           "429/529; 0: no bound")
    http.add_argument("--queue-key-share", type=float, default=d.queue_key_share,
                      metavar="FRACTION",
                      help="the most of each queue bound one API key may hold, so that a key "
                           "flooding the server leaves room for the others (1: no fairness; "
                           "requests without a key share one bound whole)")
    http.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                      help="abort a request (504, its KV released) this long after it arrived, "
                           "unless it sends its own x-request-timeout header; unset: never")
    http.add_argument("--ready-timeout", type=float, default=d.ready_timeout_s,
                      metavar="SECONDS",
                      help="GET /health/ready: how long its 1-token generation may take")
    http.add_argument("--watchdog-stall", type=float, default=d.watchdog_stall_s,
                      metavar="SECONDS",
                      help="an engine step running this long (once warm-up has run) logs "
                           "every thread's stack and turns /health and /health/ready to 503 "
                           "until it ends")
    http.add_argument("--watchdog-exit", type=float, default=d.watchdog_exit_s,
                      metavar="SECONDS",
                      help="an engine step running this long exits the process (status 71) for "
                           "a supervisor to restart; 0: never")


def _accounting_flags(caching: argparse._ArgumentGroup) -> None:
    caching.add_argument("--cache-accounting", choices=CACHE_ACCOUNTING_MODES, default="engine",
                         help="usage fields: engine = what the prefix cache really reused and "
                              "wrote; vendor = the vendor's documented rules (Anthropic's on "
                              "/v1/messages, OpenAI's on the OpenAI routes)")
    caching.add_argument("--min-cacheable-tokens", type=int, default=None,
                         help="vendor accounting: the minimum cacheable prefix for every model; "
                              "unset: each model profile's own (1,024 for claude-sonnet-4-5)")
    caching.add_argument("--prices", default=None, metavar="FILE",
                         help="JSON price overrides per model profile or model-id prefix "
                              "($/MTok and cache multipliers); unset: the built-in table")
    caching.add_argument("--enable-clock-control", action="store_true",
                         help="TESTS ONLY: mount POST /debug/clock/advance, which moves the "
                              "engine's clock forward so cache TTLs expire without waiting")


def _responses_flags(store: argparse._ArgumentGroup) -> None:
    store.add_argument("--responses-dir", default=None, metavar="DIR",
                       help="where stored responses live as token sequences (one SQLite file; "
                            "survives restarts); default: responses/ in the --kv-offload-dir, "
                            "else in $RADIXSERVE_HOME (~/.cache/radixserve)")
    store.add_argument("--responses-ttl", type=float, default=3600.0, metavar="SECONDS",
                       help="how long an unused stored response lives (each use renews it); "
                            "its prefix stays pinned in the KV cache (and the disk tier) as long")
    store.add_argument("--responses-max-mb", type=float, default=1024.0, metavar="MB",
                       help="the store's bound on disk; least recently used responses go first")


def _responses_dir(args: argparse.Namespace) -> str:
    if args.responses_dir:
        return str(args.responses_dir)
    if args.kv_offload_dir:
        return os.path.join(args.kv_offload_dir, "responses")
    return str(cache_home() / "responses")


def _agent_flags(agents: argparse._ArgumentGroup) -> None:
    agents.add_argument("--strip-preambles", action=argparse.BooleanOptionalAction, default=True,
                        help="take known per-request preambles (Claude Code's "
                             "x-anthropic-billing-header line) out of the system text before "
                             "rendering, so the prompt after them stays cacheable")
    agents.add_argument("--preamble-pattern", action="append", default=None, metavar="REGEX",
                        help="also strip a first system line matching REGEX (repeatable)")
    agents.add_argument("--next-turn-prefill", action=argparse.BooleanOptionalAction,
                        default=None,
                        help="when a chat turn ends and the chat template will render it "
                             "otherwise next turn (reasoning dropped from the history), "
                             "prefill that history while the engine is idle, evicted first and "
                             "yielding to any request, so the next turn hits the cache "
                             "(default: on where it applies, one server on the radix cache; asked for "
                             "elsewhere, it is refused)")
    agents.add_argument("--max-tokens-policy", choices=MAX_TOKENS_POLICIES, default="refuse",
                        help="a request whose prompt plus max_tokens exceeds the context: "
                             "refuse (400, as Anthropic and vLLM do) or clamp max_tokens to "
                             "the room left (header x-radixserve-max-tokens-clamped)")


def _from_flags(cls: type[SettingsT], args: argparse.Namespace, **values: object) -> SettingsT:
    """`cls` with each field set from the flag of the same name, if any; `values` set the
    fields whose flags are named otherwise (or need work), and win over the flags."""
    named = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)  # type: ignore[arg-type]
             if f.init and hasattr(args, f.name)}
    return cls(**{**named, **values})


def settings_from_flags(args: argparse.Namespace) -> ServerSettings:
    keys = list(args.api_key or [])
    if os.environ.get(API_KEY_ENV):
        keys.append(os.environ[API_KEY_ENV])
    return _from_flags(
        ServerSettings, args,
        served_model_names=tuple(args.served_model_name or [args.model or DEFAULT_MODEL_NAME]),
        api_keys=tuple(keys), shutdown_timeout_s=args.shutdown_timeout, prices_path=args.prices,
        responses_dir=_responses_dir(args),
        max_queue_wait_s=args.max_queue_wait, request_timeout_s=args.request_timeout,
        ready_timeout_s=args.ready_timeout, watchdog_stall_s=args.watchdog_stall,
        watchdog_exit_s=args.watchdog_exit,
        preamble_patterns=tuple(args.preamble_pattern or ()),
        next_turn_prefill=args.next_turn_prefill is not False)


def engine_config_from_flags(args: argparse.Namespace) -> EngineConfig:
    return _from_flags(EngineConfig, args, show_progress=sys.stderr.isatty())


class StartupError(Exception):
    """Startup failed before serving; `status` is the exit status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.replicas is not None:
        return _serve_replicas(args)
    try:
        check_single(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # Heavy imports here, so `radixserve --help` stays fast.
    from radixserve.server.app import create_app
    from radixserve.server.watchdog import Watchdog

    try:
        settings, aengine = _load(args)
    except StartupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.status
    engine = aengine.engine
    app = create_app(aengine, settings)
    config = engine.config
    logger.info(
        "serving %s as %s | KV cache %d tokens (page size %d, %s) | prefix cache %s | "
        "http://%s:%d", engine.model_path, ", ".join(settings.served_model_names),
        engine.pool.num_slots, config.page_size, str(engine.dtype).removeprefix("torch."),
        config.prefix_cache, args.host, args.port)
    watchdog = Watchdog(aengine.heartbeat, app.state.radixserve.lifecycle, lambda: aengine.alive,
                        lambda: app.state.readiness.warmed, settings.watchdog_stall_s,
                        settings.watchdog_exit_s)
    watchdog.start()

    def stop() -> None:
        watchdog.stop()  # the engine stops on purpose now
        aengine.shutdown()
        engine.close()  # the disk tier's queued writes

    started = run_app(app, args, settings, stop)
    logger.info("stopped")
    return 0 if started else 1


def _serve_replicas(args: argparse.Namespace) -> int:
    try:
        check_replica_flags(args)
        settings = settings_from_flags(args)
        config = engine_config_from_flags(args)
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    return serve_replicas(args, settings, config, run_app)


def _load(args: argparse.Namespace) -> tuple[ServerSettings, AsyncEngine]:
    """The settings and the engine, loaded on its own thread; StartupError (2: bad flags or
    prices, 1: no model)."""
    from radixserve.engine.async_engine import AsyncEngine
    from radixserve.engine.engine import LLMEngine
    from radixserve.model.default_model import ModelFetchError
    from radixserve.provider_caching import load_prices
    from radixserve.server.accounting import OffsetClock

    try:
        settings = settings_from_flags(args)
        config = engine_config_from_flags(args)
        if settings.prices_path:
            load_prices(settings.prices_path)  # a bad file fails here, before the model loads
    except (ValueError, OSError) as exc:
        raise StartupError(str(exc), 2) from exc
    # Clock control swaps the engine's clock for one a test can move forward.
    clock = OffsetClock() if settings.enable_clock_control else time.monotonic
    try:
        if args.next_turn_prefill and config.prefix_cache != "radix":
            raise StartupError("--next-turn-prefill keeps its prefill in the radix tree; it "
                               "needs --prefix-cache radix", 2)
        background = settings.next_turn_prefill and config.prefix_cache == "radix"
        return settings, AsyncEngine(lambda: LLMEngine(config, clock=clock),
                                     background_prefill=background)
    except (ModelFetchError, FileNotFoundError, ValueError) as exc:
        raise StartupError(f"cannot load the model: {exc}", 1) from exc


def run_app(app: FastAPI, args: argparse.Namespace, settings: ServerSettings,
            stop: Callable[[], None]) -> bool:
    """Serves until a signal has drained the app, then calls `stop` (the engine's); whether
    uvicorn started at all."""
    import uvicorn

    lifecycle = app.state.radixserve.lifecycle

    class DrainingServer(uvicorn.Server):
        """Keeps listening while it drains, so that probes see readiness 503 and new requests
        get 503 + Retry-After; stops once nothing is in flight (a second signal: at once)."""

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if lifecycle.draining or not self.started:
                super().handle_exit(sig, frame)
                return
            logger.info("signal %d: refusing new requests, draining %d in-flight ones (up to "
                        "%.0f s)", sig, lifecycle.in_flight, settings.shutdown_timeout_s)
            lifecycle.begin_shutdown(settings.shutdown_timeout_s,
                                     on_drained=lambda: super(DrainingServer, self).handle_exit(
                                         sig, frame))

    server = DrainingServer(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level,
        access_log=args.access_log, lifespan="on",
        # A backstop only: the drain aborts what is left at shutdown_timeout itself.
        timeout_graceful_shutdown=int(settings.shutdown_timeout_s) + 5,
    ))
    # uvicorn re-raises the signal it stopped on once it is done; with this no-op handler in
    # place that ends in a normal return (exit 0), not death by the signal.
    previous = {sig: signal.signal(sig, _after_shutdown) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return bool(server.started)


def _after_shutdown(sig: int, frame: FrameType | None) -> None:
    pass


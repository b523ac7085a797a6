"""What the HTTP layer needs beyond the engine's own config: names, keys, limits.

`radixserve serve` builds one from its flags; tests and embedders build one directly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from radixserve.provider_caching.preambles import Preamble, preamble_table
from radixserve.server.reasoning import REASONING_PARSERS

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
CACHE_ACCOUNTING_MODES = ("engine", "vendor")
METRICS_COMPAT_MODES = ("vllm",)
MAX_TOKENS_POLICIES = ("refuse", "clamp")


@dataclass(frozen=True)
class ServerSettings:
    """HTTP-side settings. Engine settings live in `EngineConfig`."""

    # The names clients may send as `model`; the first is the one /v1/models lists first.
    served_model_names: tuple[str, ...] = (DEFAULT_MODEL_NAME,)
    # Bearer keys; empty means the API is open. /health and /metrics are always open.
    api_keys: tuple[str, ...] = ()
    # Each API key gets its own cache namespace, whatever cache_salt the client sends.
    isolate_tenants: bool = False
    # Requests accepted but without a first token yet (waiting or prefilling); more get 429.
    max_waiting: int = 1024
    # Admission (`admission`): prompt tokens waiting (less their expected cache hits), the
    # estimated queue wait, and the most of each bound that one API key may hold.
    max_queued_tokens: int = 65536
    max_queue_wait_s: float = 30.0
    queue_key_share: float = 0.5
    # A request's deadline when it sends no `x-request-timeout` header; None: none.
    request_timeout_s: float | None = None
    # Health (`health`): the readiness probe's generation timeout; the watchdog's limits on
    # one engine step (not ready and stacks logged past the first; exit past the second, 0:
    # never).
    ready_timeout_s: float = 10.0
    watchdog_stall_s: float = 60.0
    watchdog_exit_s: float = 300.0
    max_request_bytes: int = 32 * 2**20  # larger bodies get 413
    # SIGTERM: in-flight requests get this long to finish before they are aborted.
    shutdown_timeout_s: float = 30.0
    retry_after_s: float = 1.0  # the Retry-After sent with 503 while draining
    owned_by: str = "radixserve"
    # Usage fields: "engine" reports what the prefix cache really did; "vendor" reproduces
    # the vendor's documented accounting (Anthropic rules on /v1/messages, OpenAI's on
    # /v1/chat/completions and /v1/completions).
    cache_accounting: str = "engine"
    # Overrides every vendor profile's minimum cacheable prefix (vendor accounting only).
    min_cacheable_tokens: int | None = None
    prices_path: str | None = None  # JSON price overrides (radixserve.provider_caching.prices)
    # Mounts POST /debug/clock/advance, which moves the engine's (and the vendor
    # emulation's) clock forward so tests can expire TTLs; never in production.
    enable_clock_control: bool = False
    # The tool-call format read from model output (`tool_calls.parsers.PARSERS`); None: chosen from
    # the chat template.
    tool_call_parser: str | None = None
    # How reasoning is read from replies (`reasoning.REASONING_PARSERS`): "auto" takes the
    # model family's format (or `think` where the chat template writes think tags).
    reasoning_parser: str = "auto"
    # "vllm": /metrics also exports `vllm:` twins of the metrics vLLM has (metrics_compat).
    metrics_compat: str | None = None
    # The Responses API's store of responses as tokens (`response_store`): its directory (None:
    # in memory, lost at exit), how long an unused response lives (seconds; its prefix stays
    # pinned in the cache as long), and its bound on disk (least recently used out first).
    responses_dir: str | None = None
    responses_ttl: float = 3600.0
    responses_max_mb: float = 1024.0
    # Per-request preambles (provider_caching.preambles: Claude Code's billing header) are
    # taken out of the system text before rendering; `preamble_patterns` adds the operator's
    # own (regular expressions matched at the start of the first system text).
    strip_preambles: bool = True
    preamble_patterns: tuple[str, ...] = ()
    # A request whose prompt plus max_tokens exceeds the context: "refuse" (400, as Anthropic
    # and vLLM do) or "clamp" (max_tokens lowered to the room left, reported in a header).
    max_tokens_policy: str = "refuse"
    # When a chat turn ends and the template will render it otherwise on the next turn (a
    # reasoning family's history without the reasoning), that history is prefilled while the
    # engine is idle, at the lowest eviction priority, yielding to any request (`next_turn`,
    # `engine.background_prefill`; radix cache, one engine).
    next_turn_prefill: bool = True

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("at least one served model name is needed")
        if self.isolate_tenants and not self.api_keys:
            raise ValueError("isolate_tenants needs at least one API key (tenants are keys)")
        if self.max_waiting < 1:
            raise ValueError("max_waiting must be >= 1")
        if self.max_queued_tokens < 1 or self.max_queue_wait_s < 0:
            raise ValueError("max_queued_tokens must be >= 1, max_queue_wait_s >= 0")
        if not 0 < self.queue_key_share <= 1:
            raise ValueError("queue_key_share must be in (0, 1]")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be > 0")
        if self.ready_timeout_s <= 0 or self.watchdog_stall_s <= 0 or self.watchdog_exit_s < 0:
            raise ValueError("ready_timeout_s and watchdog_stall_s must be > 0, "
                             "watchdog_exit_s >= 0")
        if self.max_request_bytes < 1024:
            raise ValueError("max_request_bytes must be >= 1024")
        if self.shutdown_timeout_s < 0:
            raise ValueError("shutdown_timeout_s must be >= 0")
        if self.cache_accounting not in CACHE_ACCOUNTING_MODES:
            raise ValueError(f"cache_accounting must be one of {CACHE_ACCOUNTING_MODES}")
        if self.min_cacheable_tokens is not None and self.min_cacheable_tokens < 0:
            raise ValueError("min_cacheable_tokens must be >= 0")
        if self.responses_ttl <= 0 or self.responses_max_mb <= 0:
            raise ValueError("responses_ttl and responses_max_mb must be > 0")
        if self.metrics_compat is not None and self.metrics_compat not in METRICS_COMPAT_MODES:
            raise ValueError(f"metrics_compat must be one of {METRICS_COMPAT_MODES}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}")
        if self.max_tokens_policy not in MAX_TOKENS_POLICIES:
            raise ValueError(f"max_tokens_policy must be one of {MAX_TOKENS_POLICIES}")
        if self.cache_accounting == "vendor" and not self.strip_preambles:
            # The emulation assumes Anthropic's service reads the billing header as metadata
            # (Claude Code's users keep their cache there); an engine that renders it cannot
            # reproduce that accounting.
            raise ValueError("vendor cache accounting needs strip_preambles: the vendor does "
                             "not cache per-request preambles as prompt")
        self.preambles  # noqa: B018 (compiles the patterns: a bad one is a ValueError now)

    @functools.cached_property
    def preambles(self) -> tuple[Preamble, ...]:
        """The preambles stripped from requests; empty when stripping is off."""
        return preamble_table(self.preamble_patterns) if self.strip_preambles else ()

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

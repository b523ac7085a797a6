"""Every engine knob, validated in one place. CLI flags and `LLM(**kwargs)` map onto it."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

PREFIX_CACHE_MODES = ("radix", "hash", "off")
# Speculative decoding (radixserve/engine/speculative). This module imports nothing, so
# sampling_params.py, which checks a request's own choice, holds the same two values (a test
# keeps them equal).
SPECULATIVE_METHODS = ("off", "ngram", "suffix", "auto")
MAX_SPECULATIVE_TOKENS = 32
SCHEDULE_POLICIES = ("fcfs", "lpm")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# Decode attention (radixserve/layers/attention): kernel, our C++ decode attention reading the
# paged pool in place (CPU, float32/bfloat16); torch, PyTorch ops over gathered K/V (any
# device); auto, the kernel where it applies and builds.
ATTENTION_BACKENDS = ("auto", "kernel", "torch")
# Prefill attention: kernel, the decode kernel row by row (CPU, float32/bfloat16: a row's
# result does not depend on chunking or batching, so cache on == off exactly); blocked, our
# blocked causal attention on bfloat16 matmuls (CPU, bfloat16/float16); sdpa, PyTorch's
# scaled_dot_product_attention; auto, the first of these that applies here.
PREFILL_ATTENTION_BACKENDS = ("auto", "kernel", "blocked", "sdpa")
# kernel: our C++ bfloat16 matmul for steps of at most 48 tokens (CPU with AVX512-BF16);
# float-panels: our C++ float32 matmul on weights packed into 16-row panels, any row count (CPU
# with AVX2+FMA+F16C or AVX-512F); widen: half-precision weights computed in float32 from 16
# rows up (CPUs without native bfloat16, where half-precision matmuls are emulated); torch:
# nn.Linear (oneDNN on CPU); auto: the first of these that applies here (see
# radixserve/layers/linear.py).
MATMUL_BACKENDS = ("auto", "kernel", "float-panels", "widen", "torch")
# Former names, still accepted and taken as the backend they map to.
MATMUL_BACKEND_ALIASES = {"skinny-float": "float-panels"}
# auto: GGUF matrices in a format our kernel executes (radixserve/layers/quantized.py) stay in
# the file's blocks and run as they are; none: every tensor is dequantized to the compute
# dtype at load (the reference path); int8, int4: as auto, and float matrices (HF safetensors,
# F32/F16/BF16 GGUF tensors) are quantized at load, int8 to Q8_0 and int4 to Q4_1 (see
# radixserve/model/quantize.py). auto is the default: the attention kernel serves both roles,
# so a row's bits do not depend on batching or chunking, which int8 activations need (they
# turn last-bit differences into different roundings); where the kernels cannot run (CUDA,
# float16, no compiler) auto dequantizes, as none does, and says so in the log.
QUANTIZATIONS = ("auto", "none", "int8", "int4")
# Sliding-window layers' KV (radixserve/engine/window_kv.py): full, every layer keeps the whole
# context in one slot space (a cached prefix resumes at any page); window, the local layers get
# a slot space of their own holding each running request's window and chunk plus a window where
# each publish ended (chunk and prompt ends), so a cache hit is cut back to such a point.
SWA_MEMORY_MODES = ("full", "window")
# Waiting one step saves the shared tokens' compute and costs about one step's fixed overhead
# (the other requests' work in that step is done before the waiter's first token either way).
# A CPU step is compute-bound from a few dozen tokens up, so a chat template's header and a
# short system prompt already pay for it (BENCHMARKS.md, the concurrent short requests); on a
# GPU a few tokens cost next to nothing and the step's overhead dominates.
DEDUP_MIN_TOKENS = {"cpu": 8, "cuda": 32}


@dataclass
class EngineConfig:
    """Engine settings. `model=None` means the default model (SmolLM2-135M-Instruct, Q4_1)."""

    model: str | None = None
    dtype: str = "auto"  # auto: bfloat16 where the hardware runs it faster, else float32
    device: str = "auto"  # auto: cuda when available, else cpu
    kv_cache_tokens: int | None = None  # None: sized from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    page_size: int = 1
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's context length
    prefix_cache: str = "radix"
    schedule_policy: str = "fcfs"
    # lpm: a request that has waited this long is admitted in arrival order, cache-cold or not.
    lpm_max_wait_s: float = 2.0
    lpm_scan_limit: int = 128  # lpm sorts at most this many waiting requests per step
    # A request whose uncached prompt is at most this many tokens is prefilled ahead of
    # longer prompts still prefilling or waiting (within half of each step's token budget, so
    # they keep moving): a short question is not queued behind seconds of someone else's
    # long prefill. 0: arrival order.
    short_prefill_tokens: int = 256
    # Waiting requests sharing an uncached prefix at least this long with a running prefill
    # wait one step for it instead of computing it again. None: DEDUP_MIN_TOKENS by device.
    dedup_min_tokens: int | None = None
    max_pinned_fraction: float = 0.5  # cap on KV held by TTL pins (cache_control)
    attention_backend: str = "auto"  # decode attention; see ATTENTION_BACKENDS
    prefill_attention_backend: str = "auto"  # see PREFILL_ATTENTION_BACKENDS
    matmul_backend: str = "auto"  # projections of steps with few tokens; see MATMUL_BACKENDS
    quantization: str = "auto"  # see QUANTIZATIONS
    # See SWA_MEMORY_MODES; window is a no-op (with a log line) for a model whose layers are
    # not a mix of windowed and full ones. kv_cache_tokens then sizes the full-attention group.
    swa_memory: str = "full"
    # window: the window group's pool in tokens, as a fraction of the full-attention group's
    # (at least one request's window and a page; a prefill chunk shrinks to the room there is).
    swa_pool_ratio: float = 0.25
    # A Jinja chat template file used instead of the model's own (vLLM's --chat-template).
    chat_template: str | None = None
    # The disk KV tier (radixserve/kv_tier): off unless a directory is given. Every block of
    # kv_offload_block_tokens tokens a request completes is written there (and read back when
    # a prompt needs it past the pool's match), within kv_offload_gb on disk, through a write
    # queue of kv_offload_queue_mb (writes beyond it are dropped and counted).
    kv_offload_dir: str | None = None
    kv_offload_gb: float = 10.0
    kv_offload_block_tokens: int = 64
    kv_offload_queue_mb: float = 512.0
    # KV cache events (radixserve/kv_events) for an external router: off unless an endpoint
    # is given. What the radix cache stores and evicts, as blocks of kv_events_block_size
    # tokens, is published on a ZMQ PUB socket bound there (vLLM's schema and framing), with
    # the last kv_events_buffer_steps batches replayable from kv_events_replay_endpoint.
    kv_events_endpoint: str | None = None  # e.g. tcp://*:5557; port 0 binds a free port
    kv_events_replay_endpoint: str | None = None
    kv_events_block_size: int = 16
    kv_events_topic: str = ""
    kv_events_buffer_steps: int = 10_000
    # Structured output's value bounds (`engine.grammar_bounds`): integers without a range get
    # int64's; a JSON number's text and a whitespace run are capped (0: unbounded).
    grammar_int64_integers: bool = True
    grammar_max_number_chars: int = 24
    grammar_max_whitespace_run: int = 64
    # Jump forward: text a grammar forces (a forced call's opening and name, a schema's keys)
    # is taken as tokens at once and computed in one chunk, not sampled one step at a time.
    grammar_jump_forward: bool = True
    # Speculative decoding without a draft model (radixserve/engine/speculative): one of
    # SPECULATIVE_METHODS, drafting up to num_speculative_tokens per request and step. Off by
    # default until the benchmark's figures say which default pays (BENCHMARKS.md).
    speculative: str = "off"
    num_speculative_tokens: int = 4
    num_threads: int | None = None  # torch CPU threads; None keeps torch's default
    seed: int = 0  # seeds sampling for requests that carry no seed of their own
    show_progress: bool = True
    debug_invariants: bool = False  # check the slot-accounting invariant at every idle step

    def __post_init__(self) -> None:
        self.matmul_backend = MATMUL_BACKEND_ALIASES.get(self.matmul_backend, self.matmul_backend)
        self.validate()

    def validate(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        need(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        need(self.prefix_cache in PREFIX_CACHE_MODES,
             f"prefix_cache must be one of {PREFIX_CACHE_MODES}, got {self.prefix_cache!r}")
        need(self.schedule_policy in SCHEDULE_POLICIES,
             f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        need(self.attention_backend in ATTENTION_BACKENDS,
             f"attention_backend must be one of {ATTENTION_BACKENDS}, "
             f"got {self.attention_backend!r}")
        need(self.prefill_attention_backend in PREFILL_ATTENTION_BACKENDS,
             f"prefill_attention_backend must be one of {PREFILL_ATTENTION_BACKENDS}, "
             f"got {self.prefill_attention_backend!r}")
        need(self.quantization in QUANTIZATIONS,
             f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        need(self.matmul_backend in MATMUL_BACKENDS,
             f"matmul_backend must be one of {MATMUL_BACKENDS}, got {self.matmul_backend!r}")
        need(self.speculative in SPECULATIVE_METHODS,
             f"speculative must be one of {SPECULATIVE_METHODS}, got {self.speculative!r}")
        need(1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
             f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
             f"got {self.num_speculative_tokens}")
        need(self.swa_memory in SWA_MEMORY_MODES,
             f"swa_memory must be one of {SWA_MEMORY_MODES}, got {self.swa_memory!r}")
        need(0 < self.swa_pool_ratio <= 1, "swa_pool_ratio must be in (0, 1]")
        need(self.swa_memory == "full" or self.kv_offload_dir is None,
             "swa_memory='window' does not work with the disk tier (kv_offload_dir) yet: the "
             "tier stores and loads every layer's KV of a block")
        need(self.page_size >= 1, "page_size must be >= 1")
        need(self.kv_cache_tokens is None or self.kv_cache_tokens >= self.page_size,
             "kv_cache_tokens must be at least one page")
        need(self.kv_cache_memory_gb > 0, "kv_cache_memory_gb must be > 0")
        need(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        need(self.max_num_batched_tokens >= 16, "max_num_batched_tokens must be >= 16")
        need(self.short_prefill_tokens >= 0,
             f"short_prefill_tokens must be >= 0 (0: off), got {self.short_prefill_tokens}")
        need(self.dedup_min_tokens is None or self.dedup_min_tokens >= 1,
             f"dedup_min_tokens must be >= 1 (or None: by device), got {self.dedup_min_tokens}")
        need(self.kv_offload_gb > 0, "kv_offload_gb must be > 0")
        need(self.kv_offload_queue_mb > 0, "kv_offload_queue_mb must be > 0")
        need(self.kv_offload_block_tokens >= 1
             and self.kv_offload_block_tokens % self.page_size == 0,
             f"kv_offload_block_tokens must be a positive multiple of page_size "
             f"({self.page_size}), got {self.kv_offload_block_tokens}")
        need(self.kv_offload_dir is None or self.prefix_cache != "off",
             "kv_offload_dir needs a prefix cache (radix or hash): the tier holds what the "
             "cache evicts")
        need(self.kv_events_endpoint is None or self.prefix_cache == "radix",
             "kv_events_endpoint needs prefix_cache='radix'")
        need(self.kv_events_replay_endpoint is None or self.kv_events_endpoint is not None,
             "kv_events_replay_endpoint needs kv_events_endpoint")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            endpoint = getattr(self, name)
            need(endpoint is None or "://" in endpoint,
                 f"{name} must be a ZMQ endpoint such as tcp://*:5557, got {endpoint!r}")
        need(self.kv_events_block_size >= 1, "kv_events_block_size must be >= 1")
        need(self.kv_events_endpoint is None or self.kv_events_block_size % self.page_size == 0,
             f"kv_events_block_size must be a multiple of page_size ({self.page_size}), "
             f"got {self.kv_events_block_size}")
        need(self.kv_events_buffer_steps >= 1, "kv_events_buffer_steps must be >= 1")
        need(self.grammar_max_number_chars >= 0 and self.grammar_max_whitespace_run >= 0,
             "grammar_max_number_chars and grammar_max_whitespace_run must be >= 0")
        need(0 <= self.max_pinned_fraction <= 1, "max_pinned_fraction must be in [0, 1]")
        need(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
             f"device must be auto, cpu or cuda[:N], got {self.device!r}")

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine settings {unknown}; known: {sorted(known)}")
        return cls(model=model, **kwargs)

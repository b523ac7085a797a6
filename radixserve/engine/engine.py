"""The engine: owns the model, the KV pool, the prefix cache and the scheduler, and runs the
step loop: schedule -> run (model and sampler) -> postprocess (every state change).

Synchronous and single-threaded; `AsyncEngine` runs it beside an asyncio event loop.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import radixserve
from radixserve.cache import RadixCache, make_prefix_cache
from radixserve.config import EngineConfig
from radixserve.engine.detokenizer import Detokenizer
from radixserve.engine.grammar_bounds import ValueBounds
from radixserve.engine.kv_offload import KVOffload
from radixserve.engine.kv_pool import KVPool
from radixserve.engine.limits import EngineLimits
from radixserve.engine.postprocess import Postprocessor, make_output
from radixserve.engine.request import Request
from radixserve.engine.runner import ModelRunner
from radixserve.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from radixserve.engine.setup import (
    build_attention,
    kv_pool_shape,
    load_model,
    resolve_device,
    resolve_dtype,
)
from radixserve.engine.speculative.cost_model import MEASURED_ROWS, StepCostModel
from radixserve.engine.speculative.policy import Speculation, SpeculationSettings
from radixserve.engine.structured_output import GrammarCompiler
from radixserve.engine.window_kv import FullKV, WindowKV
from radixserve.kernels.cpu import describe as describe_cpu
from radixserve.kv_tier.blocks import ModelFingerprint, weights_identity
from radixserve.kv_tier.store import TierStore
from radixserve.model.rope import rotary_identity
from radixserve.outputs import RequestOutput
from radixserve.sampling_params import SamplingParams
from radixserve.sequences import namespace_bytes

if TYPE_CHECKING:  # imported only when events are on: pyzmq is needed for nothing else
    from radixserve.kv_events import KVEventPublisher, KVEventRecorder

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolStats:
    """Where every KV slot is. free + evictable + protected + pinned + private == total."""

    total: int
    free: int
    evictable: int
    protected: int
    pinned: int
    private: int

    @property
    def balanced(self) -> bool:
        return self.free + self.evictable + self.protected + self.pinned + self.private == self.total


class LLMEngine:
    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        loaded = load_model(config, self.device, self.dtype)
        self.model_path, self.model, self.tokenizer = loaded.path, loaded.model, loaded.tokenizer
        if config.chat_template is not None:
            self.tokenizer.chat_template = Path(config.chat_template).read_text()
        self.model_config = mc = loaded.config
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings,
                                 mc.max_position_embeddings)
        shape = kv_pool_shape(config, mc, self.dtype)
        self.pool = KVPool(mc.num_layers, shape.pages, config.page_size, mc.num_kv_heads,
                           mc.head_dim, self.dtype, self.device, shape.window_layers,
                           shape.window_pages)
        self.window_kv = (FullKV(self.pool.allocator.release)
                          if self.pool.window_allocator is None
                          else WindowKV(self.pool.window_allocator, shape.pages, shape.window,
                                        self.pool.allocator.release))
        self.limits = EngineLimits(mc.vocab_size, self.max_model_len, self.pool.num_slots,
                                   mc.family)
        self.cache = make_prefix_cache(config.prefix_cache, config.page_size,
                                       self.window_kv.release_full, clock=clock,
                                       max_pinned_tokens=int(self.pool.num_slots
                                                             * config.max_pinned_fraction))
        attention = build_attention(
            config, mc, self.pool.num_slots, self.device, self.dtype,
            shape.window_pages * config.page_size if shape.window_layers else None)
        self.offload = self._kv_offload(attention.name) if config.kv_offload_dir else None
        self.speculation = Speculation(SpeculationSettings(
            config.speculative, config.num_speculative_tokens, self.max_model_len))
        self.scheduler = Scheduler(config, self.pool.allocator, self.cache, clock,
                                   tier=self.offload, device_type=self.device.type,
                                   speculation=self.speculation, window_kv=self.window_kv)
        # Requests without a seed of their own draw from this one generator (vLLM's rule).
        generator = torch.Generator().manual_seed(config.seed)
        self.runner = ModelRunner(self.model, self.pool, attention, self.device, generator,
                                  window_kv=self.window_kv)
        self.detokenizer = Detokenizer(self.tokenizer, self.max_model_len)
        self.grammars = GrammarCompiler(self.tokenizer, bounds=ValueBounds(
            config.grammar_int64_integers, config.grammar_max_number_chars,
            config.grammar_max_whitespace_run))
        self.postprocessor = Postprocessor(self.scheduler, self.detokenizer, clock,
                                           jump_forward=config.grammar_jump_forward)
        self.groups: dict[str, list[Request]] = {}
        # Cumulative seconds: scheduling and bookkeeping vs the model with sampling.
        self.bookkeeping_seconds = 0.0
        self.model_seconds = 0.0
        # KV cache events for an external router; `kv_events` gives its bound endpoints.
        # Started last, so that a failed start leaves no thread or bound port behind.
        self._kv_recorder: KVEventRecorder | None = None
        self.kv_events: KVEventPublisher | None = None
        if config.speculative == "auto":
            # Each probe row holds a page: a small pool measures fewer row counts.
            pages = self.pool.allocator.free_slots // config.page_size
            self.speculation.cost = StepCostModel.measure(
                self._timed_forward, rows=tuple(n for n in MEASURED_ROWS if n <= pages))
            logger.info("speculation cost model: step seconds %s at rows %s",
                        [round(t, 4) for t in self.speculation.cost.seconds],
                        list(self.speculation.cost.rows))
        if config.kv_events_endpoint:
            self._start_kv_events()
        logger.info(
            "model %s (%s, %s on %s, CPU %s): KV pool %d tokens in pages of %d, prefix cache "
            "%s; attention: %s; projections: %s",
            self.model_path, mc.architecture, str(self.dtype).removeprefix("torch."),
            self.device, describe_cpu(), self.pool.num_slots, config.page_size,
            config.prefix_cache, attention.name, self.model.linear_method.describe(),
        )

    def _kv_offload(self, attention: str) -> KVOffload:
        config, mc = self.config, self.model_config
        assert config.kv_offload_dir is not None
        fingerprint = ModelFingerprint(
            weights=weights_identity(self.model_path),
            dtype=str(self.dtype).removeprefix("torch."),
            quantization=config.quantization,
            projections=self.model.linear_method.describe(),
            attention=attention,
            num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
            page_size=config.page_size, block_tokens=config.kv_offload_block_tokens,
            software=f"radixserve {radixserve.__version__}, torch {torch.__version__}",
            rotary=rotary_identity(self.model.rope_tables),
        )
        clock = self.clock
        # Pins outlive the process, so the tier keeps them in wall-clock time; this clock
        # moves with the engine's (a test's clock control moves both).
        store = TierStore(config.kv_offload_dir, fingerprint,
                          capacity_bytes=int(config.kv_offload_gb * 1e9),
                          queue_bytes=int(config.kv_offload_queue_mb * 1e6),
                          wall_clock=lambda: time.time() + clock() - time.monotonic())
        stats = store.stats()
        logger.info("KV tier %s: %d entries (%.2f GB of %.2f), %d pinned; index rebuilt in "
                    "%.3f s%s", store.dir, stats.entries, stats.bytes / 1e9,
                    store.capacity_bytes / 1e9, stats.pinned_entries, store.scan_seconds,
                    "" if store.writable else " (read-only)")
        return KVOffload(store, self.pool, config.kv_offload_block_tokens, clock)

    def _start_kv_events(self) -> None:
        from radixserve.kv_events import KVEventPublisher, KVEventRecorder

        config = self.config
        assert config.kv_events_endpoint is not None
        assert isinstance(self.cache, RadixCache)  # config validation allows radix only
        medium = "GPU" if self.device.type == "cuda" else "CPU"
        # The cache keys requests by (model, tenant namespace); events carry the tenant's,
        # which is what a router can compute from a request.
        self._kv_recorder = KVEventRecorder(config.kv_events_block_size, medium,
                                            namespace_of=lambda namespace: namespace[1])
        self.kv_events = KVEventPublisher(
            config.kv_events_endpoint, config.kv_events_replay_endpoint,
            topic=config.kv_events_topic, buffer_steps=config.kv_events_buffer_steps)
        self.cache.observer = self._kv_recorder
        logger.info("KV cache events on %s (replay: %s), blocks of %d tokens",
                    self.kv_events.endpoint, self.kv_events.replay_endpoint or "off",
                    config.kv_events_block_size)

    def _publish_kv_events(self) -> None:
        """Sends what the cache did since the last call as one batch (none when nothing)."""
        if self._kv_recorder is None or self.kv_events is None:
            return
        events = self._kv_recorder.drain()
        if events:
            self.kv_events.publish(events)

    def close(self, timeout: float = 30.0) -> None:
        """Finishes the disk tier's queued writes (up to `timeout` seconds) and sends the
        queued KV cache events. Call once the engine has stopped stepping; without a tier or
        events it does nothing."""
        if self.offload is not None:
            self.offload.close(timeout)
        if self.kv_events is not None:
            self._publish_kv_events()
            self.kv_events.close()

    # ----- requests -----

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        namespace: Hashable = None,
        pins: list[tuple[int, float]] | None = None,
        counted: bool = True,
    ) -> str:
        """Queues a prompt (text or token ids); returns its id. Raises ValueError on bad input.

        `namespace` (a tenant's cache_salt) keeps its cache entries apart from other tenants'.
        `pins` are (token offset, TTL seconds) breakpoints whose prefixes stay cached that long;
        an offset past the prompt covers the output too, as far as it has KV at the finish.
        `counted=False` keeps the server's own requests (health probes) out of the counters.
        """
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.offload is not None:
            try:
                namespace_bytes(namespace)  # the tier keys entries by it
            except TypeError as exc:
                raise ValueError(str(exc)) from exc
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_prompt(ids, params)
        # n samples are n requests with one prompt: the prefix cache lets the later ones hit
        # the first's prefill instead of recomputing it.
        group = [
            Request(f"{request_id}-{i}" if params.n > 1 else request_id, ids, params,
                    namespace=(self.config.model, namespace), prompt=text, sample_index=i,
                    arrival_time=self.clock(), pins=list(pins or []), group_id=request_id,
                    counted=counted)
            for i in range(params.n)
        ]
        if params.structured_outputs is not None:
            for request in group:
                request.matcher = self.grammars.matcher(params.structured_outputs)
        self.groups[request_id] = group
        for request in group:
            self.scheduler.add(request)
        return request_id

    def check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        """The one check of a request against this engine: its sampling params, and a prompt
        that can be served (not empty, ids in the vocabulary, fits the context and the pool).
        Raises ValueError naming the problem."""
        self.limits.check(ids, params, self.grammars)
        if params.speculative == "auto" and self.speculation.cost is None:
            raise ValueError("speculative 'auto' needs an engine started with speculative="
                             "'auto' (its cost model is measured at start-up)")

    def abort_request(self, request_id: str) -> None:
        """Ends a request at any point; everything it holds is released. Unknown ids: no-op."""
        for request in self.groups.pop(request_id, []):
            self.scheduler.finish(request, "abort")  # caches what the request computed
        self._publish_kv_events()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # ----- the step -----

    def step(self) -> list[RequestOutput]:
        """Runs one batch; returns the outputs of every request group that progressed."""
        outputs = self._step()
        self._publish_kv_events()
        return outputs

    def _step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.empty:
            self._check_invariants()
            return []
        self._check_slot_mirrors(plan)
        if plan.decodes or plan.verifies:
            self.speculation.counters.steps += 1
            self.speculation.counters.speculative_steps += bool(plan.verifies)
        model_started = time.perf_counter()
        try:
            result = self.runner.run(plan, self.detokenizer.banned_tokens)
        except Exception:
            # A failed forward pass leaves undefined KV in the scheduled requests' slots: fail
            # them without publishing that KV, and keep serving the rest.
            logger.exception("forward pass failed; failing %d requests", plan.num_requests)
            return self._outputs(self.scheduler.fail(plan))
        model_done = time.perf_counter()
        outputs = self._outputs(self.postprocessor.apply(plan, result))
        finished = time.perf_counter()
        self.model_seconds += model_done - model_started
        self.bookkeeping_seconds += (model_started - started) + (finished - model_done)
        if not plan.prefills:
            self.speculation.observe_step(finished - started, plan.num_tokens)
        return outputs

    def _outputs(self, progressed: list[Request]) -> list[RequestOutput]:
        outputs = []
        for group_id in dict.fromkeys(r.group_id for r in progressed):
            group = self.groups.get(group_id)
            if group is None:
                continue
            output = make_output(group_id, group)
            if output.finished:
                del self.groups[group_id]
            outputs.append(output)
        return outputs

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Float32 next-token logits after `token_ids`, by one uncached prefill (for scoring and
        tests). Runs only on an idle engine; holds no KV afterwards."""
        if self.scheduler.has_work():
            raise RuntimeError("prompt_logits needs an idle engine")
        self.check_prompt(token_ids, SamplingParams(max_tokens=0))
        return self._forward_uncached([token_ids])[0]

    def _timed_forward(self, rows: int) -> None:
        """One uncached forward of `rows` one-token requests, each with its logits: the rows
        and logits of a decode or verify step (the speculation cost model's probe)."""
        self._forward_uncached([[(7 * i + 1) % self.model_config.vocab_size]
                                for i in range(rows)])

    def _forward_uncached(self, prompts: list[list[int]]) -> torch.Tensor:
        """Float32 logits at each prompt's last token, from one forward that prefills every
        prompt whole as a request of its own, cache unread; holds no KV afterwards."""
        page_size = self.pool.page_size
        requests = [Request(f"uncached-{i}", list(ids), SamplingParams(max_tokens=1))
                    for i, ids in enumerate(prompts)]
        pages = [-(-len(ids) // page_size) for ids in prompts]
        self.cache.evict(sum(pages) * page_size - self.pool.allocator.free_slots)
        self._publish_kv_events()
        try:
            for request, n in zip(requests, pages, strict=True):
                request.slots = self.pool.allocator.allocate(n)
                if self.window_kv.reserve(request, request.num_tokens) < request.num_tokens:
                    raise ValueError(f"prompt_logits: {request.num_tokens} tokens do not fit "
                                     "the sliding-window layers' pool at once")
            return self.runner.forward(SchedulerOutput(
                prefills=[ScheduledChunk(r, r.num_tokens) for r in requests]))[0]
        finally:
            for request in requests:
                self.window_kv.release(request)
                if request.slots:
                    self.pool.allocator.release(request.slots)

    # ----- accounting -----

    def pool_stats(self) -> PoolStats:
        cache = self.cache.stats()
        return PoolStats(
            total=self.pool.num_slots,
            free=self.pool.allocator.free_slots,
            evictable=cache.evictable_tokens,
            protected=cache.protected_tokens,
            pinned=cache.pinned_tokens,
            private=self.scheduler.private_slots(),
        )

    def _check_slot_mirrors(self, plan: SchedulerOutput) -> None:
        if self.config.debug_invariants:
            stale = [r.request_id for r in self.scheduler.holders if not r.slot_mirror_ok()]
            assert not stale, f"slot mirrors out of step with slot tables: {stale}"
            reads = [(r, r.num_computed + 1) for r in plan.decodes] + [
                (c.request, c.request.num_computed + c.num_tokens) for c in plan.prefills]
            self.window_kv.check(self.scheduler.holders, reads)

    def _check_invariants(self) -> None:
        if not self.config.debug_invariants:
            return
        stats = self.pool_stats()
        assert stats.balanced, f"KV slot accounting broken: {stats}"
        if self.scheduler.has_work():  # waiting on a tier load: not idle
            return
        assert stats.protected == 0 and stats.private == 0, f"idle engine holds KV: {stats}"

"""The engine: owns the model, the KV pool, the prefix cache and the scheduler, and runs the
step loop: schedule -> run the model -> sample -> update requests (finish, publish KV).

Synchronous and single-threaded; `AsyncEngine` runs it beside an asyncio event loop.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from radixserve.cache import make_prefix_cache
from radixserve.config import EngineConfig
from radixserve.engine.kv_pool import KVPool
from radixserve.engine.request import Request, RequestStatus
from radixserve.engine.runner import ModelRunner
from radixserve.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from radixserve.kernels import decode_attention_op, skinny_matmul_op
from radixserve.model.default_model import resolve_model_path
from radixserve.model.llama import LlamaModel
from radixserve.model.loader import load_model_files
from radixserve.outputs import CompletionOutput, RequestOutput
from radixserve.sampling_params import SamplingParams

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


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _cpu_has_fast_bf16() -> bool:
    # bfloat16 matmuls beat float32 (about 2.4x on this project's machines) only where the CPU
    # has native bf16 dot products; elsewhere they are emulated and slower.
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if _cpu_has_fast_bf16() else torch.float32


class LLMEngine:
    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        path = resolve_model_path(config.model)
        loaded = load_model_files(path, progress=config.show_progress)
        self.model_path = str(path)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        with torch.device("meta"):
            model = LlamaModel(loaded.config)
        model.load_hf_weights(loaded.weights, self.dtype)
        del loaded
        self.model = model.to(self.device).eval()
        mc = self.model_config
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings,
                                 mc.max_position_embeddings)
        bytes_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * self.dtype.itemsize
        tokens = config.kv_cache_tokens or int(config.kv_cache_memory_gb * 2**30 // bytes_per_token)
        num_pages = max(1, tokens // config.page_size)
        self.pool = KVPool(mc.num_layers, num_pages, config.page_size, mc.num_kv_heads,
                           mc.head_dim, self.dtype, self.device)
        pinned = int(self.pool.num_slots * config.max_pinned_fraction)
        self.cache = make_prefix_cache(config.prefix_cache, config.page_size,
                                       self.pool.allocator.release, clock=clock,
                                       max_pinned_tokens=pinned)
        self.scheduler = Scheduler(config, self.pool.allocator, self.cache, clock)
        self.runner = ModelRunner(self.model, self.pool, self.device,
                                  decode_kernel=self._kernel(
                                      "attention_backend", config.attention_backend,
                                      (torch.float32, torch.bfloat16), decode_attention_op,
                                      "a CPU device and float32 or bfloat16"),
                                  matmul_kernel=self._kernel(
                                      "matmul_backend", config.matmul_backend,
                                      (torch.bfloat16,), skinny_matmul_op,
                                      "a CPU with AVX512-BF16 and bfloat16"))
        self.groups: dict[str, list[Request]] = {}
        self.computed_tokens_total = 0  # every token run through the model
        self.step_count = 0
        # Cumulative seconds: scheduling and cache bookkeeping vs. the model (with sampling).
        self.bookkeeping_seconds = 0.0
        self.model_seconds = 0.0
        logger.info(
            "model %s (%s, %s on %s): KV pool %d tokens in pages of %d, prefix cache %s, "
            "decode attention %s, matmuls of few rows %s",
            self.model_path, mc.architecture, str(self.dtype).removeprefix("torch."),
            self.device, self.pool.num_slots, config.page_size, config.prefix_cache,
            "kernel" if self.runner.decode_kernel else "torch",
            "kernel" if self.runner.matmul_kernel else "torch",
        )

    def _kernel(
        self, setting: str, backend: str, dtypes: tuple[torch.dtype, ...],
        load: Callable[[], Callable[..., torch.Tensor] | None], needs: str,
    ) -> Callable[..., torch.Tensor] | None:
        """A C++ kernel's op when `backend` asks for it and it applies to this engine; with
        backend "kernel", a clear error where it cannot."""
        if backend == "torch":
            return None
        applies = self.device.type == "cpu" and self.dtype in dtypes
        op = load() if applies else None
        if op is None and backend == "kernel":
            where = "" if applies else f" (this engine runs {self.dtype} on {self.device})"
            raise ValueError(f"{setting}='kernel' needs {needs}, and a C++ compiler to build "
                             f"the kernel{where}")
        return op

    # ----- requests -----

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        namespace: Hashable = None,
        pins: list[tuple[int, float]] | None = None,
    ) -> str:
        """Queues a prompt (text or token ids); returns its id. Raises ValueError on bad input.

        `namespace` (a tenant's cache_salt) keeps its cache entries apart from other tenants'.
        `pins` are (prompt offset, TTL seconds) breakpoints whose prefixes stay cached that long.
        """
        params.validate()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_prompt(ids, params)
        # n samples are n requests with one prompt: the prefix cache lets the later ones hit
        # the first's prefill instead of recomputing it.
        group = [
            Request(f"{request_id}-{i}" if params.n > 1 else request_id, ids, params,
                    namespace=(self.config.model, namespace), prompt=text, sample_index=i,
                    arrival_time=self.clock(), pins=list(pins or []))
            for i in range(params.n)
        ]
        self.groups[request_id] = group
        for request in group:
            self.scheduler.add(request)
        return request_id

    def check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError when the prompt cannot be served (empty, too long, bad ids)."""
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len}"
            )
        need = len(ids) + params.max_tokens
        if need > self.pool.num_slots:
            raise ValueError(
                f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                f"KV pool ({self.pool.num_slots} tokens); lower max_tokens or raise kv_cache_tokens"
            )

    def abort_request(self, request_id: str) -> None:
        """Ends a request at any point; everything it holds is released. Unknown ids: no-op."""
        for request in self.groups.pop(request_id, []):
            self.scheduler.finish(request, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # ----- the step -----

    def step(self) -> list[RequestOutput]:
        """Runs one batch; returns the outputs of every request group that progressed."""
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.empty:
            self._check_invariants()
            return []
        self.step_count += 1
        if self.config.debug_invariants:
            stale = [r.request_id for r in self.scheduler.running if not r.slot_mirror_ok()]
            assert not stale, f"slot mirrors out of step with slot tables: {stale}"
        progressed: set[str] = set()
        model_started = time.perf_counter()
        try:
            result = self.runner.run(plan, self._banned_tokens)
        except Exception:
            # A failed forward pass leaves undefined KV in the scheduled requests' slots: fail
            # them without publishing that KV, and keep serving the rest.
            failed = list(plan.decodes) + [c.request for c in plan.prefills]
            logger.exception("forward pass failed; failing %d requests", len(failed))
            for request in failed:
                self.scheduler.finish(request, "error", keep_kv=False)
                progressed.add(self._group_id(request))
            return self._outputs(progressed)
        model_done = time.perf_counter()
        self.model_seconds += model_done - model_started
        self.computed_tokens_total += plan.num_tokens
        for chunk in plan.prefills:
            chunk.request.num_computed += chunk.num_tokens
            self.scheduler.counters.computed_prompt_tokens += chunk.num_tokens
            self.scheduler.publish(chunk.request)
        for request in plan.decodes:
            request.num_computed += 1
        now = self.clock()
        for request, token, logprob in zip(
            result.sampled, result.samples.token_ids, result.samples.logprobs, strict=True
        ):
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            request.output_token_ids.append(token)
            if logprob is not None:
                request.output_logprobs.append(logprob)
            self._check_stop(request)
            progressed.add(self._group_id(request))
        outputs = self._outputs(progressed)
        self.bookkeeping_seconds += (model_started - started) + (time.perf_counter() - model_done)
        return outputs

    def _group_id(self, request: Request) -> str:
        if request.params.n == 1:
            return request.request_id
        return request.request_id.rsplit("-", 1)[0]

    def _banned_tokens(self, request: Request) -> set[int] | None:
        if len(request.output_token_ids) >= request.params.min_tokens:
            return None
        return set(request.params.stop_token_ids) | (
            set() if request.params.ignore_eos else self.tokenizer.stop_token_ids
        )

    def _check_stop(self, request: Request) -> None:
        params = request.params
        token = request.output_token_ids[-1]
        reason: str | None = None
        stop_reason: str | int | None = None
        if not params.ignore_eos and token in self.tokenizer.stop_token_ids:
            reason, stop_reason = "stop", token
        elif token in params.stop_token_ids:
            reason, stop_reason = "stop", token
        text = self.tokenizer.decode(request.output_token_ids)
        if reason is None and params.stop:
            # Only the new text (plus a stop string's length of overlap) can hold a new match.
            overlap = max(len(s) for s in params.stop)  # type: ignore[union-attr]
            begin = max(0, len(request.output_text) - overlap)
            hits = [(text.find(s, begin), s) for s in params.stop if text.find(s, begin) >= 0]  # type: ignore[union-attr]
            if hits:
                cut, stop_string = min(hits)
                text = text[:cut]
                reason, stop_reason = "stop", stop_string
        if text.endswith("\ufffd") and reason is None:
            # An incomplete UTF-8 sequence: hold it back until the next token completes it.
            text = text.rstrip("\ufffd")
        request.output_text = text
        if reason is None and len(request.output_token_ids) >= params.max_tokens:
            reason = "length"
        if reason is None and request.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            request.stop_reason = stop_reason
            request.metrics.finished_time = self.clock()
            self.scheduler.finish(request, reason)

    def _outputs(self, group_ids: set[str]) -> list[RequestOutput]:
        outputs = []
        for gid in group_ids:
            group = self.groups.get(gid)
            if group is None:
                continue
            output = self.make_output(gid, group)
            if output.finished:
                del self.groups[gid]
            outputs.append(output)
        return outputs

    def make_output(self, group_id: str, group: list[Request]) -> RequestOutput:
        first = group[0]
        completions = [
            CompletionOutput(
                index=r.sample_index,
                text=r.output_text,
                token_ids=list(r.output_token_ids),
                finish_reason=r.finish_reason,
                stop_reason=r.stop_reason,
                logprobs=list(r.output_logprobs) if r.params.logprobs is not None else None,
            )
            for r in group
        ]
        return RequestOutput(
            request_id=group_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=completions,
            finished=all(r.status is RequestStatus.FINISHED for r in group),
            num_cached_tokens=first.num_cached_tokens or 0,
            metrics=first.metrics,
        )

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Float32 next-token logits after `token_ids`, by one uncached prefill (for scoring and
        tests). Runs only on an idle engine; holds no KV afterwards."""
        if self.scheduler.has_work():
            raise RuntimeError("prompt_logits needs an idle engine")
        self.check_prompt(token_ids, SamplingParams(max_tokens=0))
        request = Request("logits", list(token_ids), SamplingParams(max_tokens=1))
        pages = -(-len(token_ids) // self.pool.page_size)
        self.cache.evict(pages * self.pool.page_size - self.pool.allocator.free_slots)
        request.slots = self.pool.allocator.allocate(pages)
        try:
            plan = SchedulerOutput(prefills=[ScheduledChunk(request, len(token_ids))])
            batch, _ = self.runner.build_batch(plan)
            return self.model(batch, self.pool.k, self.pool.v)[0]
        finally:
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

    def _check_invariants(self) -> None:
        if not self.config.debug_invariants:
            return
        stats = self.pool_stats()
        assert stats.balanced, f"KV slot accounting broken: {stats}"
        assert stats.protected == 0 and stats.private == 0, f"idle engine holds KV: {stats}"

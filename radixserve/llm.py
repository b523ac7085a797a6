"""The offline API (a contract): `LLM(model=None, **config).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from radixserve.config import EngineConfig
from radixserve.engine.engine import LLMEngine, PoolStats
from radixserve.model.tokenizer import ChatTokenizer
from radixserve.outputs import RequestOutput
from radixserve.sampling_params import SamplingParams

PromptInput = str | dict[str, Any] | list[int]


class LLM:
    """A model with its engine, for batch generation in-process.

    `model` is an HF directory, a `.gguf` path, or None for the default model; every
    `EngineConfig` field can be passed by keyword (page_size, kv_cache_tokens, dtype, ...).
    """

    def __init__(self, model: str | None = None, **config: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **config))

    def close(self) -> None:
        """Finishes the disk KV tier's queued writes (with `kv_offload_dir`) and stops its
        threads; use the LLM no more afterwards. Leaving a `with LLM(...) as llm:` does it."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self) -> ChatTokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """One result per prompt, in order. Prompts are strings or {"prompt_token_ids": [...]}.
        `SamplingParams(prompt_logprobs=k, max_tokens=0)` scores a prompt: see
        `RequestOutput.prompt_logprobs`."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if prompts and isinstance(prompts[0], int):  # a bare list of token ids is one prompt
            prompts = [prompts]  # type: ignore[list-item]
        params = self._params_per_prompt(sampling_params, len(prompts))
        return self._run([self._prompt_value(p) for p in prompts], params, use_tqdm, cache_salt)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        tools: list[dict[str, Any]] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation or a list of them;
        `chat_template_kwargs` are extra template arguments (e.g. {"enable_thinking": False})."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        extra = chat_template_kwargs or {}
        token_ids = [self.tokenizer.encode_chat(conv, tools, **extra)  # type: ignore[arg-type]
                     for conv in conversations]
        params = self._params_per_prompt(sampling_params, len(token_ids))
        return self._run(token_ids, params, use_tqdm, cache_salt)

    def pool_stats(self) -> PoolStats:
        return self.engine.pool_stats()

    # -----

    @staticmethod
    def _params_per_prompt(
        params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams() for _ in range(count)]
        if isinstance(params, SamplingParams):
            return [params] * count
        if len(params) != count:
            raise ValueError(f"{len(params)} sampling params for {count} prompts")
        return list(params)

    @staticmethod
    def _prompt_value(prompt: PromptInput) -> str | list[int]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return str(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        return prompt

    def _run(
        self,
        prompts: list[str | list[int]],
        params: list[SamplingParams],
        use_tqdm: bool,
        cache_salt: str | None,
    ) -> list[RequestOutput]:
        engine = self.engine
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                ids.append(engine.add_request(prompt, p, namespace=cache_salt))
        except Exception:
            for rid in ids:  # a bad prompt in the batch: leave nothing queued or allocated
                engine.abort_request(rid)
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", disable=not (use_tqdm and self.engine.config.show_progress))
        try:
            # On past the last output while finished requests settle their tails' KV
            # (Scheduler.settling), so the engine is idle when this returns.
            while len(results) < len(ids) or engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        results[output.request_id] = output
                        bar.update(1)
        except BaseException:
            for rid in ids:
                engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [results[rid] for rid in ids]

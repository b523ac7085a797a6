"""Output text and stop conditions: incremental detokenisation, stop strings, stop tokens,
EOS, min_tokens and length limits. Called once per sampled token by the step's postprocess.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.engine.request import Request
from radixserve.model.tokenizer import ChatTokenizer
from radixserve.outputs import FinishReason


@dataclass(frozen=True)
class Stop:
    reason: FinishReason
    stop_reason: str | int | None = None  # the stop string or token id that ended it


class Detokenizer:
    def __init__(self, tokenizer: ChatTokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def banned_tokens(self, request: Request, ahead: int = 0) -> set[int] | None:
        """Tokens the request may not produce `ahead` tokens from now (a draft's later
        positions): its stop tokens, before min_tokens."""
        params = request.params
        if len(request.output_token_ids) + ahead >= params.min_tokens:
            return None
        eos = set() if params.ignore_eos else self.tokenizer.stop_token_ids
        return set(params.stop_token_ids) | eos

    def update(self, request: Request) -> Stop | None:
        """Brings `request.output_text` up to its newest token; returns why it must stop, if
        it must (a stop string is cut from the text)."""
        params = request.params
        token = request.output_token_ids[-1]
        stop: Stop | None = None
        if (not params.ignore_eos and token in self.tokenizer.stop_token_ids) or (
                token in params.stop_token_ids):
            stop = Stop("stop", token)
        text = self.tokenizer.decode(request.output_token_ids)
        if stop is None and params.stop:
            cut = self._stop_string(params.stop, text, len(request.output_text))  # type: ignore[arg-type]
            if cut is not None:
                text, stop = text[: cut[0]], Stop("stop", cut[1])
        if stop is None and text.endswith("\ufffd"):
            # An incomplete UTF-8 sequence: hold it back until the next token completes it.
            text = text.rstrip("\ufffd")
        request.output_text = text
        if stop is None and (len(request.output_token_ids) >= params.max_tokens
                             or request.num_tokens >= self.max_model_len):
            stop = Stop("length")
        return stop

    @staticmethod
    def _stop_string(stops: list[str], text: str, old_length: int) -> tuple[int, str] | None:
        """Where the first stop string starts in `text`, and which; only the new text (plus a
        stop string's length of overlap) can hold a new match."""
        begin = max(0, old_length - max(len(s) for s in stops))
        hits = [(at, s) for s in stops if (at := text.find(s, begin)) >= 0]
        return min(hits) if hits else None

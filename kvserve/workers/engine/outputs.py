"""What an engine step reports per request, and what ``LLM.generate`` returns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestOutput:
    """One step's news for one request: the tokens and text it added, and whether it is done."""

    request_id: str
    new_token_ids: tuple[int, ...]
    text_delta: str
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    num_preemptions: int = 0
    num_swaps: int = 0
    # Per new token, {token id: logprob} (the sampled token and the top-k), when the request asked.
    new_logprobs: tuple[dict[int, float], ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    """A finished generation (offline API)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int
    num_preemptions: int
    logprobs: list[dict[int, float]] | None = None  # per output token, when SamplingParams.logprobs is set

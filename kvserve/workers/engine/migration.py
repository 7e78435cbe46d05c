"""Continuing a request on another worker: live migration and replay.

Live migration: ``MigrationState`` is produced by ``LLMEngine.export_request`` at a step boundary,
carried as a Ray object and consumed by ``LLMEngine.import_request`` on another worker. The KV
blocks travel bit-exact, so the continuation is token-identical to an undisturbed run.

Replay (failover): when the worker is gone, nothing can be exported; the router knows only the
prompt and the output tokens it already streamed. ``rebuild_output_text`` recomputes, from those
alone, the text state the original worker had, and the engine recomputes the KV.

Both paths rely on the same fact: a request's seeded RNG is a function of (seed, output index)
(``workers.engine.sampler.TokenRNG``), so no generator state travels, and a request rebuilt from its
seed and its output tokens draws exactly what the original would have drawn next.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.stop_checker import advance_output
from kvserve.workers.text.tokenizer import DetokenizerState, IncrementalDetokenizer, Tokenizer


@dataclass
class MigrationState:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int
    cache_salt: str | None
    arrival_time: float
    num_computed_tokens: int
    block_size: int
    model_id: str
    # Per layer [2, num_blocks, block_size, num_kv_heads, head_dim] on the host; None when the
    # request holds no KV (waiting, or preempted by recompute): the importer recomputes it.
    kv_blocks: list[torch.Tensor] | None
    # int8 caches only: per layer [2, num_blocks, block_size, num_kv_heads] fp32 scales of kv_blocks.
    kv_scales: list[torch.Tensor] | None
    output_text: str
    detokenizer: DetokenizerState | None  # window + offsets: text held back mid-character moves too
    num_cached_tokens: int
    num_preemptions: int
    num_swaps: int
    # (address, key) of the request's owner (kvserve/workers/core/request.py ``WorkerRequest.owner``); the
    # worker sets it on export and reads it on import (the engine does not use it). None: the router.
    owner: tuple[str, str] | None = None
    resume_grant: tuple[str, ...] = ()  # its ``WorkerRequest.resume_grant``, carried as ``owner`` is
    # An owned request's logprobs so far, when it asked for them (the worker's, carried as ``owner`` is: a take-over
    # after the migration resends them; kvserve/workers/transport/reown.py).
    logprobs: tuple[dict[int, float], ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def kv_bytes(self) -> int:
        tensors = (self.kv_blocks or []) + (self.kv_scales or [])
        return sum(t.numel() * t.element_size() for t in tensors)


def rebuild_output_text(
    tokenizer: Tokenizer | None,
    prompt_token_ids: list[int],
    output_token_ids: list[int],
    params: SamplingParams,
    eos_token_ids: Collection[int],
    max_model_len: int,
) -> tuple[IncrementalDetokenizer | None, str]:
    """The detokenizer and the handed-out text of a request that has produced ``output_token_ids``.

    Feeds the outputs one by one through the same ``advance_output`` the engine runs per step, so
    the result equals the original worker's state after its last streamed token: the same
    detokenizer window (a multi-byte character split across the cut stays held back) and the
    same text shown (a stop string's prefix at the end stays held back, and completes or is
    released by the next token as it would have been). O(len(output_token_ids)) small decodes.

    Args:
        tokenizer: The model's tokenizer; None gives (None, "") (token ids only).
        prompt_token_ids: The original prompt.
        output_token_ids: Output tokens already streamed to the client.
        params: The request's sampling parameters (stop rules).
        eos_token_ids: The ids that end generation.
        max_model_len: The model's context length.

    Returns:
        ``(detokenizer, shown_text)``.

    Raises:
        ValueError: when a stop rule fires within ``output_token_ids``: such a request had
            finished, and there is nothing to continue.
    """
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids) if tokenizer is not None else None
    shown = ""
    outputs: list[int] = []
    for token in output_token_ids:
        outputs.append(token)
        reason, delta = advance_output(
            outputs, detokenizer, shown, params, eos_token_ids,
            len(prompt_token_ids) + len(outputs) >= max_model_len,
        )  # fmt: skip
        if reason is not None:
            raise ValueError(
                f"the request finished ({reason}) at output token {len(outputs)} of {len(output_token_ids)}; "
                "nothing to resume"
            )
        shown += delta
    return detokenizer, shown

"""Per-request sampling parameters: how to pick each next token and when to stop.

A frozen, validated value object: the router builds it from the client request, the worker's
``Sampler`` and ``check_stop`` read it. Switches that are "off" use a neutral value, never -1:
``top_k == 0`` and ``top_p == 1.0`` mean no truncation, ``temperature == 0`` means greedy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# torch.Generator.manual_seed takes any 64-bit value; keep seeds non-negative so they are
# portable to other RNGs and across the wire (uint64 in the proto).
_MAX_SEED = 2**64
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's output tokens.

    Attributes:
        max_tokens: Most output tokens to generate (> 0); reaching it finishes with "length".
        temperature: Softmax temperature (>= 0); 0 means greedy (argmax), ignoring top_k/top_p/seed.
        top_k: Keep only the k most likely tokens; 0 turns top-k off (never -1). A k larger than
            the vocabulary keeps everything.
        top_p: Nucleus sampling: keep the smallest set of most likely tokens whose probability
            mass reaches top_p; in (0, 1], 1.0 turns it off.
        seed: Per-request RNG seed in [0, 2**64) for reproducible sampling (same seed, same
            logits -> same tokens, whatever else is in the batch); None uses the global RNG.
        stop: Strings that end generation when they appear in the decoded output; the returned
            text is cut before the stop string. Lists are accepted and stored as tuples.
        stop_token_ids: Token ids that end generation (the id stays in the output ids).
        ignore_eos: Keep generating past the model's EOS token (benchmarks).
        logprobs: None for none; k in [0, 20] to get, per output token, the log-probability of the
            sampled token and of the k most likely ones (``{token id: logprob}``), from the
            unmodified logits (before temperature and truncation), as vLLM reports them.

    Raises:
        ValueError: naming the field, when a value is out of range or of the wrong kind.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # NOTE: frozen dataclass, so normalising lists to tuples goes through object.__setattr__;
        # tuples keep the object hashable and safe to share between requests.
        object.__setattr__(self, "stop", _as_tuple(self.stop, "stop"))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids"))
        self._validate()

    def _validate(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        # `not x >= 0` also rejects NaN.
        if not _is_real(self.temperature) or not self.temperature >= 0 or math.isinf(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < _MAX_SEED):
            raise ValueError(f"seed must be None or an int in [0, 2**64), got {self.seed!r}")
        for s in self.stop:
            # An empty stop string would match at once and finish every request immediately.
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must hold ints >= 0, got {t!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature == 0); no RNG is used."""
        return self.temperature == 0.0


def _as_tuple(value: object, field: str) -> tuple:
    # A bare string is a Sequence too; treating "END" as ("E", "N", "D") would be a silent bug.
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ValueError(f"{field} must be a list or tuple, got {type(value).__name__}")
    return tuple(value)


def _is_int(value: object) -> bool:
    # bool is an int subclass; True as max_tokens is almost certainly a caller bug.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)

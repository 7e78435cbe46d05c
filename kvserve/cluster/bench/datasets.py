"""Datasets and arrival processes of ``kvserve bench serve`` (pure: no gRPC, no Ray, no torch).

Every dataset is a deterministic function of its config and a seed, and yields token-id prompts
(the model's tokenizer is not involved, so prompt lengths are exact).

* ``random``: independent prompts with lengths uniform in ``[input_len_min, input_len_max]``.
* ``shared-prefix``: SGLang's ``generated-shared-prefix`` shape. ``num_groups`` system prompts of
  ``system_prompt_len`` tokens, each followed by ``prompts_per_group`` distinct questions of
  ``question_len`` tokens; the requests are shuffled. With ``zipf_s`` set, the group of each of
  the ``num_groups * prompts_per_group`` requests is drawn with Zipf popularity ``1 / rank**s``
  instead (every question still distinct). With ``tenants > 1`` each request gets a tenant drawn
  uniformly; a tenant salts the cache, so a system prompt only hits for the same tenant.
* ``multi-turn``: ``num_users`` conversations of ``num_rounds`` rounds. Round 1's prompt is a
  ``system_prompt_len``-token preamble (per user) plus a question; round ``r + 1``'s prompt is the
  whole conversation so far (round ``r``'s prompt and answer) plus a new question of
  ``question_len`` tokens; it is sent only after round ``r``'s answer has arrived.
* ``workload``: one of the standard offline workloads (``cluster.bench.workloads``), the served
  twin of ``kvserve bench offline`` (``--compare-offline``).

Arrivals (``arrival_times``): a renewal process with gamma inter-arrival times of mean
``1 / rate`` and shape ``burstiness`` (1 = Poisson; < 1 burstier; > 1 more regular), the same
convention as ``vllm bench serve``; ``rate = inf`` sends everything at t = 0. For multi-turn, the
arrivals are the conversations' first rounds.

``ideal_cached_tokens`` is the yardstick of the prefix-cache hit rate: the prompt tokens an
infinite, never-evicting cache shared by all workers could have served, given the sequences
actually sent in the order they were sent.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

DATASETS = ("random", "shared-prefix", "multi-turn", "workload")


@dataclass(frozen=True)
class BenchRequest:
    """One request of a dataset.

    Attributes:
        prompt: token ids (for a multi-turn round after the first: the new question only; the
            conversation so far is prepended when the round is sent).
        max_tokens: output tokens to generate (sent with ``ignore_eos``).
        tenant: cache salt ("" = none).
        group: shared-prefix group, or the multi-turn user (-1 when neither).
        round: multi-turn round, from 0 (0 elsewhere).
    """

    prompt: tuple[int, ...]
    max_tokens: int
    tenant: str = ""
    group: int = -1
    round: int = 0


@dataclass(frozen=True)
class Conversation:
    """What the driver sends: requests in order; request ``i + 1`` only after ``i`` has answered.

    Every non-multi-turn request is a conversation of one round.
    """

    rounds: tuple[BenchRequest, ...]
    chained: bool = False  # True: each round's prompt extends the previous prompt + answer


@dataclass(frozen=True)
class DatasetConfig:
    """The ``--dataset`` options (``--random-*``, ``--gsp-*``, ``--mt-*``), validated.

    Raises:
        ValueError: unknown dataset or a value out of range.
    """

    name: str = "random"
    vocab_size: int = 32000
    num_prompts: int = 100
    input_len_min: int = 16
    input_len_max: int = 256
    output_len: int = 64
    gsp_num_groups: int = 8
    gsp_prompts_per_group: int = 16
    gsp_system_prompt_len: int = 512
    gsp_question_len: int = 64
    gsp_output_len: int = 32
    zipf_s: float | None = None
    tenants: int = 1
    mt_num_users: int = 8
    mt_num_rounds: int = 4
    mt_system_prompt_len: int = 128
    mt_question_len: int = 32
    mt_output_len: int = 32
    workload: str = "tiny"

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"dataset must be one of {', '.join(DATASETS)}, got {self.name!r}")
        positive = (
            "vocab_size", "num_prompts", "input_len_min", "output_len", "gsp_num_groups", "gsp_prompts_per_group",
            "gsp_question_len", "gsp_output_len", "tenants", "mt_num_users", "mt_num_rounds", "mt_question_len",
            "mt_output_len",
        )  # fmt: skip
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("gsp_system_prompt_len", "mt_system_prompt_len"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.input_len_max < self.input_len_min:
            raise ValueError(f"input_len_max ({self.input_len_max}) < input_len_min ({self.input_len_min})")
        if self.zipf_s is not None and self.zipf_s <= 0:
            raise ValueError(f"zipf_s must be > 0, got {self.zipf_s}")


def build_dataset(cfg: DatasetConfig, seed: int) -> list[Conversation]:
    """The conversations of ``cfg``, deterministic in ``(cfg, seed)``."""
    rng = random.Random(seed)
    if cfg.name == "random":
        return [Conversation((req,)) for req in _random(cfg, rng)]
    if cfg.name == "shared-prefix":
        return [Conversation((req,)) for req in _shared_prefix(cfg, rng)]
    if cfg.name == "multi-turn":
        return _multi_turn(cfg, rng)
    from kvserve.cluster.bench.workloads import prompts

    ids, out = prompts(cfg.workload, vocab=cfg.vocab_size)
    return [Conversation((BenchRequest(tuple(p), out),)) for p in ids]


def _tokens(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(vocab) for _ in range(n))


def _random(cfg: DatasetConfig, rng: random.Random) -> list[BenchRequest]:
    return [
        BenchRequest(_tokens(rng, rng.randint(cfg.input_len_min, cfg.input_len_max), cfg.vocab_size), cfg.output_len)
        for _ in range(cfg.num_prompts)
    ]


def zipf_weights(n: int, s: float) -> list[float]:
    """Normalised Zipf popularity of ranks 1..n: ``w_k = k**-s / sum_j j**-s``."""
    raw = [k**-s for k in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def _shared_prefix(cfg: DatasetConfig, rng: random.Random) -> list[BenchRequest]:
    systems = [_tokens(rng, cfg.gsp_system_prompt_len, cfg.vocab_size) for _ in range(cfg.gsp_num_groups)]
    total = cfg.gsp_num_groups * cfg.gsp_prompts_per_group
    if cfg.zipf_s is None:
        groups = [g for g in range(cfg.gsp_num_groups) for _ in range(cfg.gsp_prompts_per_group)]
        rng.shuffle(groups)
    else:
        groups = rng.choices(range(cfg.gsp_num_groups), weights=zipf_weights(cfg.gsp_num_groups, cfg.zipf_s), k=total)
    out = []
    for g in groups:
        tenant = f"tenant-{rng.randrange(cfg.tenants)}" if cfg.tenants > 1 else ""
        question = _tokens(rng, cfg.gsp_question_len, cfg.vocab_size)
        out.append(BenchRequest(systems[g] + question, cfg.gsp_output_len, tenant, g))
    return out


def _multi_turn(cfg: DatasetConfig, rng: random.Random) -> list[Conversation]:
    conversations = []
    for user in range(cfg.mt_num_users):
        tenant = f"tenant-{user % cfg.tenants}" if cfg.tenants > 1 else ""
        first = _tokens(rng, cfg.mt_system_prompt_len + cfg.mt_question_len, cfg.vocab_size)
        rounds = [BenchRequest(first, cfg.mt_output_len, tenant, user, 0)]
        for r in range(1, cfg.mt_num_rounds):
            rounds.append(BenchRequest(_tokens(rng, cfg.mt_question_len, cfg.vocab_size), cfg.mt_output_len,
                                       tenant, user, r))  # fmt: skip
        conversations.append(Conversation(tuple(rounds), chained=True))
    return conversations


def num_requests(conversations: Sequence[Conversation]) -> int:
    return sum(len(c.rounds) for c in conversations)


def max_prompt_len(conversations: Sequence[Conversation]) -> int:
    """Longest prompt any round can be sent with (chained rounds include every earlier answer)."""
    longest = 0
    for c in conversations:
        length = 0
        for i, r in enumerate(c.rounds):
            length = length + len(r.prompt) if c.chained else len(r.prompt)
            longest = max(longest, length)
            if c.chained and i + 1 < len(c.rounds):
                length += r.max_tokens
    return longest


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send offsets (seconds from the start, non-decreasing) of ``n`` arrivals.

    Args:
        n: arrivals.
        rate: mean arrivals per second (``math.inf``: all at 0).
        burstiness: gamma shape (1 = Poisson).
        seed: RNG seed; the same arguments give the same list.

    Raises:
        ValueError: ``n < 0``, ``rate <= 0`` or ``burstiness <= 0``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.gammavariate(burstiness, theta)
        out.append(t)
    return out


def schedule_digest(conversations: Sequence[Conversation], arrivals: Sequence[float]) -> str:
    """A short fingerprint of what a run sends and when (equal digests = identical arrivals)."""
    h = hashlib.sha256()
    for c, t in zip(conversations, arrivals, strict=True):
        h.update(f"{t:.9f}|{int(c.chained)}".encode())
        for r in c.rounds:
            h.update(f"|{r.tenant}|{r.max_tokens}|{len(r.prompt)}:".encode())
            h.update(",".join(map(str, r.prompt)).encode())
    return h.hexdigest()[:16]


@dataclass
class _Seen:
    chains: set[tuple[str, int]] = field(default_factory=set)


def ideal_cached_tokens(sent: Iterable[tuple[str, Sequence[int], Sequence[int]]], block_size: int) -> int:
    """Prompt tokens an infinite, shared prefix cache could have served.

    Args:
        sent: ``(tenant, prompt ids, output ids)`` in the order the requests were sent. A request
            can hit full blocks of any earlier request's prompt + output (the workers cache
            generated blocks too), for the same tenant.
        block_size: tokens per KV block.

    Returns:
        The sum over requests of ``block_size * min(leading blocks seen before, (len(prompt) - 1)
        // block_size)`` (the last prompt token is always computed, as in ``router.placement``).

    Raises:
        ValueError: ``block_size < 1``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    seen = _Seen()
    total = 0
    for tenant, prompt, output in sent:
        prompt_chain = _chain(prompt, block_size)
        hits = 0
        for h in prompt_chain[: (len(prompt) - 1) // block_size]:
            if (tenant, h) not in seen.chains:
                break
            hits += 1
        total += hits * block_size
        # NOTE: the last sampled token is never computed (no KV), so it cannot be part of a cached block.
        sequence = list(prompt) + list(output)[:-1]
        seen.chains.update((tenant, h) for h in _chain(sequence, block_size))
    return total


def _chain(tokens: Sequence[int], block_size: int) -> list[int]:
    out, parent = [], 0
    for i in range(len(tokens) // block_size):
        parent = hash((parent, tuple(tokens[i * block_size : (i + 1) * block_size])))
        out.append(parent)
    return out

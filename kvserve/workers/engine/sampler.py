"""Next-token sampling for a batch: greedy, temperature, top-k, top-p, per-request seeds.

All masking is batched over the vocabulary; the only per-sequence Python work is drawing noise
for seeded rows, because each seeded row must use its own ``torch.Generator``.

Sampling uses the exponential race (Gumbel-max in disguise): ``argmax(probs / E)`` with
``E ~ Exponential(1)`` i.i.d. per token picks token i with probability ``probs[i]``. Unlike
``torch.multinomial`` it needs no CPU sync per row and the noise for a row depends only on that
row's generator, so a seeded request gets the same tokens whatever else shares its batch.

Seeded requests draw through a ``TokenRNG``: the noise for output token ``i`` comes from a
generator seeded with ``mix(seed, i)`` (counter-based, like a Philox key/offset), not from one
generator that advances. A request's sampling is therefore a function of (seed, tokens drawn so
far) alone: a migrated request or a replay on another worker continues with nothing carried but
the seed and its output tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvserve.workers.core.sampling_params import SamplingParams


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded with ``seed`` on ``device``, or None when the request is unseeded.

    The generator must live on the device of the logits it samples from; keep it in the
    request's state so consecutive steps continue one reproducible stream.
    """
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One round of SplitMix64: a bijective 64-bit mixer with full avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def token_seed(seed: int, index: int) -> int:
    """The generator seed for output token ``index`` of a request seeded with ``seed``.

    NOTE: both halves of ``seed`` and the index are mixed into every output bit, because the CPU
    generator (mt19937) keeps only the low 32 bits of its seed: seeds 1 and 1 + 2**32 must not
    share a stream, nor must (seed, i) and (seed', i') collide in any simple pattern.
    """
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (index & _MASK64))


class TokenRNG:
    """A seeded request's randomness, reproducible from (seed, output index).

    ``at(i)`` returns a generator positioned at the start of output token ``i``'s noise; it is
    the same generator object re-seeded each call (cheap on CPU and CUDA), so hold it only for
    one draw.

    Args:
        seed: The request's seed in [0, 2**64).
        device: The device of the logits it samples from.
    """

    def __init__(self, seed: int, device: torch.device | str = "cpu") -> None:
        self.seed = seed
        self._generator = torch.Generator(device=device)

    def at(self, index: int) -> torch.Generator:
        """The generator for output token ``index`` (0-based); raises ValueError if negative."""
        if index < 0:
            raise ValueError(f"output index must be >= 0, got {index}")
        return self._generator.manual_seed(token_seed(self.seed, index))


def make_token_rng(seed: int | None, device: torch.device | str = "cpu") -> TokenRNG | None:
    """A ``TokenRNG`` for a seeded request, or None when the request is unseeded (global RNG)."""
    return None if seed is None else TokenRNG(seed, device)


class Sampler:
    """Picks one token id per row of a logits batch according to each row's SamplingParams."""

    def __call__(
        self,
        logits: Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        """``sample`` read back to the host: the sampled token id of each row, in row order."""
        return self.sample(logits, params, generators).tolist()

    def sample(
        self,
        logits: Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> Tensor:
        """Sample the next token of every sequence, leaving the ids on the logits' device.

        NOTE: no device→host read happens here (no ``tolist``/``item``), so the caller owns the
        step's one sync (``host_ids.HostIds``) and may feed the ids to the next step on the device.

        Args:
            logits: ``[num_seqs, vocab]`` float32 next-token logits (not modified).
            params: One SamplingParams per row.
            generators: One per row: the row's seeded generator (``TokenRNG.at(index)`` of the
                token being drawn, or ``make_generator``) or None for the global RNG. Ignored for
                greedy rows, which consume no randomness.

        Returns:
            ``[num_seqs]`` int64 sampled ids on ``logits.device``, in row order.

        Raises:
            ValueError: when logits is not 2-D or the list lengths differ from num_seqs.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [num_seqs, vocab], got shape {tuple(logits.shape)}")
        num_seqs = logits.shape[0]
        if len(params) != num_seqs or len(generators) != num_seqs:
            raise ValueError(f"got {num_seqs} logits rows, {len(params)} params, {len(generators)} generators")
        tokens = logits.argmax(dim=-1)  # [num_seqs]; random rows are overwritten below
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:  # the common all-greedy batch is a single argmax
            return tokens
        row_index = torch.tensor(rows, device=logits.device)
        sampled = self._sample(
            logits.index_select(0, row_index).float(),
            [params[i] for i in rows],
            [generators[i] for i in rows],
        )
        return tokens.index_copy_(0, row_index, sampled)

    def _sample(self, logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> Tensor:
        """Sample every row of ``logits`` ``[n, vocab]`` (all rows non-greedy); returns ``[n]`` ids."""
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
        logits = logits / temperature.unsqueeze(1)  # a copy: the caller's logits stay intact

        # Only pay for the sort when some row actually truncates.
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            top_k = torch.tensor([p.top_k for p in params], device=device)
            top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=device)
            logits = _apply_top_k_top_p(logits, top_k, top_p)

        probs = logits.softmax(dim=-1)  # [n, vocab]
        noise = _exponential_noise(probs, generators)
        return probs.div_(noise).argmax(dim=-1)


def _apply_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Set logits outside each row's top-k / nucleus to -inf.

    Args:
        logits: ``[n, vocab]`` temperature-scaled logits.
        top_k: ``[n]`` int; 0 means off.
        top_p: ``[n]`` float in (0, 1]; 1.0 means off.

    Returns:
        ``[n, vocab]`` logits with at least the most likely token of every row kept.
    """
    vocab = logits.shape[1]
    # NOTE: a stable sort breaks ties by token id, the same way argmax does, so top_k=1 and a
    # tiny top_p agree with greedy even on ties, and results do not depend on the batch.
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)  # [n, vocab]
    rank = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, vocab)
    drop = rank.unsqueeze(0) >= k.unsqueeze(1)  # [n, vocab]

    # Nucleus over what top-k kept (top-k first, as vLLM and HF do). A token is dropped once the
    # mass strictly before it already reaches top_p; the first token has zero mass before it.
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(1)

    sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def _exponential_noise(probs: Tensor, generators: list[torch.Generator | None]) -> Tensor:
    """``Exponential(1)`` noise shaped like ``probs`` ``[n, vocab]``; seeded rows use their generator."""
    noise = torch.empty_like(probs)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if len(seeded) < len(generators):
        # All unseeded rows in one draw from the global RNG.
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if seeded:
            fresh = torch.empty(len(unseeded), probs.shape[1], dtype=probs.dtype, device=probs.device)
            fresh.exponential_()
            noise.index_copy_(0, torch.tensor(unseeded, device=probs.device), fresh)
        else:
            noise.exponential_()
    for i in seeded:
        # One generator per row so a row's noise depends only on its own seed and step count.
        noise[i].exponential_(generator=generators[i])
    # exponential_ can return exactly 0; 0/0 would be NaN, and argmax treats NaN as the maximum,
    # which could pick a masked (probability 0) token.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)

"""The prefix-cache block hash: ``hash_blocks`` (packed once per prompt) is the chain of ``hash_block``, and its
values do not change between versions (blocks on the disk tier and other processes' indexes are keyed by them)."""

import random

from kvserve.workers.core.block_hash import ROOT_HASH, hash_block, hash_blocks


def _chain(ids: list[int], block_size: int, extra: str, parent: int) -> list[int]:
    out = []
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = hash_block(parent, ids[start : start + block_size], extra)
        out.append(parent)
    return out


def test_hash_blocks_is_the_chain_of_hash_block() -> None:
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(-3, 2**40) for _ in range(rng.randrange(0, 200))]
        block_size, extra, parent = rng.choice([1, 3, 4, 16]), rng.choice(["", "m\x00t", "ü\x00"]), rng.randrange(2**64)
        assert hash_blocks(ids, block_size, extra, parent) == _chain(ids, block_size, extra, parent)
        assert hash_blocks(tuple(ids), block_size, extra) == _chain(ids, block_size, extra, ROOT_HASH)


def test_the_values_are_stable() -> None:
    # NOTE: computed by the per-block implementation before hash_blocks packed the prompt once
    assert hash_blocks(list(range(10)), 4, "m\x00t") == [4219627147131281295, 9290354572739332833]

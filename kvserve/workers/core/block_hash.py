"""The prefix-cache block hash, shared by workers and the router (one function, one module).

``h_i = H(h_{i-1}, tokens of full block i, extra)``, H = sha256 truncated to 64 bits. ``extra`` is
the cache salt (per tenant) and the model id, so tenants and models never share cached blocks.
Only full blocks are hashed. Never Python ``hash()``: it is salted per process.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# Parent of the first block: a fixed value so chains are comparable across processes.
ROOT_HASH = 0
_PARENT = struct.Struct("<Q")


def hash_block(parent: int, token_ids: Sequence[int], extra: str = "") -> int:
    """Hash of one full block given its parent's hash; a stable unsigned 64-bit int."""
    return _chain(parent, struct.pack(f"<{len(token_ids)}q", *token_ids), extra.encode())


def hash_blocks(
    token_ids: Sequence[int], block_size: int, extra: str = "", parent: int = ROOT_HASH
) -> list[int]:
    """Hash chain of every full block of ``token_ids`` (a trailing partial block is not hashed)."""
    # NOTE: the tokens packed once for the whole prompt, not per block: the router hashes every prompt it
    # places, so this loop is part of its CPU per request (issue 41)
    full = len(token_ids) // block_size
    packed = memoryview(struct.pack(f"<{full * block_size}q", *token_ids[: full * block_size]))
    tail, step = extra.encode(), 8 * block_size
    hashes: list[int] = []
    for start in range(0, full * step, step):
        parent = _chain(parent, packed[start : start + step], tail)
        hashes.append(parent)
    return hashes


def _chain(parent: int, block: bytes | memoryview, tail: bytes) -> int:
    """H(parent, the block's packed tokens, extra): sha256 truncated to 64 bits, little-endian."""
    h = hashlib.sha256(_PARENT.pack(parent))
    h.update(block)
    h.update(tail)
    return int.from_bytes(h.digest()[:8], "little")


def cache_extra(model_id: str, cache_salt: str | None) -> str:
    """The ``extra`` input of the hash: model id plus tenant salt."""
    return f"{model_id}\x00{cache_salt or ''}"

"""BlockStore: atomic per-block files, header and checksum checks, LRU within a byte budget, demotion."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvserve.workers.engine.block_store import HEADER_BYTES, BlockStore

PAYLOAD = 64
LAYOUT = "model-a|layers=2|block=[4, 8]x16|dtype=torch.float16|scales=none"


def _payload(i: int) -> bytes:
    return bytes((i + k) % 256 for k in range(PAYLOAD))


def _store(tmp_path: Path, blocks: int, name: str = "host", **kw: object) -> BlockStore:
    return BlockStore(tmp_path / name, blocks * (HEADER_BYTES + PAYLOAD), LAYOUT, PAYLOAD, name, **kw)  # type: ignore[arg-type]


def _age(store: BlockStore, h: int, seconds_ago: float) -> None:
    """Set a file's last use explicitly: mtime granularity must not decide the LRU order in a test."""
    t = time.time() - seconds_ago
    os.utime(store.path(h), (t, t))


def test_round_trip_and_put_is_idempotent(tmp_path: Path) -> None:
    s = _store(tmp_path, 4)
    assert s.get(7) is None and not s.contains(7)
    assert s.put(7, _payload(7)) is True
    assert s.put(7, _payload(7)) is False  # already there: only its recency is refreshed
    assert s.contains(7) and s.get(7) == _payload(7)
    assert s.hashes() == [7]
    assert not [p for p in s.directory.iterdir() if p.name.startswith(".tmp-")]


def test_wrong_payload_size_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="payload"):
        _store(tmp_path, 4).put(1, b"short")


def test_budget_must_hold_one_block(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot hold one"):
        BlockStore(tmp_path, HEADER_BYTES + PAYLOAD - 1, LAYOUT, PAYLOAD, "host")


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[: len(data) // 2],  # torn
        lambda data: data[:-1] + bytes([data[-1] ^ 1]),  # a flipped payload bit: checksum
        lambda data: b"NOTABLK!" + data[8:],  # not a block file
        lambda data: data[:HEADER_BYTES],  # header only
    ],
)
def test_damaged_file_is_never_served_and_is_removed(tmp_path: Path, damage) -> None:  # type: ignore[no-untyped-def]
    s = _store(tmp_path, 4)
    s.put(5, _payload(5))
    path = s.path(5)
    path.write_bytes(damage(path.read_bytes()))
    assert s.get(5) is None
    assert not path.exists() and s.num_rejected == 1


def test_file_of_another_hash_is_not_served(tmp_path: Path) -> None:
    """A file renamed (or copied) to another block's name: the header's hash disagrees."""
    s = _store(tmp_path, 4)
    s.put(5, _payload(5))
    os.replace(s.path(5), s.path(6))
    assert s.get(6) is None


def _other_layout(ours: BlockStore, **kw: object) -> BlockStore:
    """A store of another layout (the same model's bf16 KV) on ``ours``'s directory and budget."""
    return BlockStore(ours.directory, ours.capacity_bytes, LAYOUT.replace("float16", "bfloat16"), PAYLOAD,
                      ours.name, **kw)  # type: ignore[arg-type]  # fmt: skip


def test_other_layout_file_is_a_miss_and_left_alone(tmp_path: Path) -> None:
    ours = _store(tmp_path, 4)
    theirs = _other_layout(ours)
    theirs.put(9, _payload(9))
    assert ours.get(9) is None and ours.hashes() == [] and ours.num_rejected == 0
    assert theirs.path(9).exists() and theirs.get(9) == _payload(9)


def test_two_layouts_store_the_same_hash_side_by_side(tmp_path: Path) -> None:
    """The same block hash in two layouts (fp16 and bf16 KV of one model): each layout keeps and serves
    its own file. (With names of the bare hash the second ``put`` found the first's file, kept it, and
    its layout never got the block: a disk tier shared by two KV dtypes served one of them nothing.)"""
    ours = _store(tmp_path, 4)
    theirs = _other_layout(ours)
    theirs_payload = bytes(reversed(_payload(3)))
    assert ours.put(3, _payload(3)) is True
    assert theirs.put(3, theirs_payload) is True
    assert ours.get(3) == _payload(3) and theirs.get(3) == theirs_payload
    assert ours.hashes() == [3] and theirs.hashes() == [3]
    assert ours.used_bytes() == theirs.used_bytes() == 2 * ours.file_bytes  # one budget per directory


def test_layouts_share_one_lru_and_each_is_demoted_under_its_own_name(tmp_path: Path) -> None:
    disk = _store(tmp_path, 8, name="disk")
    host = _store(tmp_path, 2, name="host", demote_to=disk)
    other_host = _other_layout(host)
    other_disk = _other_layout(disk)
    other_host.put(1, _payload(1))
    _age(other_host, 1, seconds_ago=100)  # the other layout's block is the oldest
    host.put(1, _payload(11))
    _age(host, 1, seconds_ago=90)
    host.put(2, _payload(2))
    ev = host.evict_to_budget()
    assert ev.removed == [] and ev.demoted == []  # the victim was not this layout's: nothing to report
    assert other_disk.get(1) == _payload(1) and not other_host.contains(1)
    assert host.get(1) == _payload(11) and not disk.contains(1)
    host.put(3, _payload(3))
    _age(host, 1, seconds_ago=80)
    assert host.evict_to_budget().demoted == [1] and disk.get(1) == _payload(11)


def test_file_of_the_old_naming_is_never_served_but_is_swept(tmp_path: Path) -> None:
    s = _store(tmp_path, 1)
    legacy = s.directory / f"{5:016x}.kvb"
    s.put(5, _payload(5))
    os.replace(s.path(5), legacy)
    _age_path(legacy, 100)
    assert s.get(5) is None and s.hashes() == [] and s.used_bytes() == s.file_bytes
    s.put(6, _payload(6))
    assert s.evict_to_budget().removed == [] and not legacy.exists() and s.hashes() == [6]


def _age_path(path: Path, seconds_ago: float) -> None:
    t = time.time() - seconds_ago
    os.utime(path, (t, t))


def test_lru_eviction_keeps_most_recently_used(tmp_path: Path) -> None:
    s = _store(tmp_path, 3)
    for h in (1, 2, 3, 4):
        s.put(h, _payload(h))
        _age(s, h, seconds_ago=100 - h)  # 1 oldest ... 4 newest
    _age(s, 1, seconds_ago=0)  # ... then 1 is used again
    ev = s.evict_to_budget()
    assert ev.removed == [2] and ev.demoted == []
    assert sorted(s.hashes()) == [1, 3, 4]
    assert s.used_bytes() <= s.capacity_bytes


def test_get_refreshes_recency(tmp_path: Path) -> None:
    s = _store(tmp_path, 2)
    for h in (1, 2):
        s.put(h, _payload(h))
        _age(s, h, seconds_ago=100 - h)
    assert s.get(1) == _payload(1)  # 1 is now the most recent
    s.put(3, _payload(3))
    assert s.evict_to_budget().removed == [2]


def test_eviction_demotes_to_next_tier_in_the_same_format(tmp_path: Path) -> None:
    disk = _store(tmp_path, 8, name="disk")
    host = _store(tmp_path, 2, name="host", demote_to=disk)
    for h in (1, 2, 3):
        host.put(h, _payload(h))
        _age(host, h, seconds_ago=100 - h)
    ev = host.evict_to_budget()
    assert ev.removed == [1] and ev.demoted == [1]
    assert not host.contains(1) and disk.get(1) == _payload(1)


def test_damaged_file_is_not_demoted(tmp_path: Path) -> None:
    disk = _store(tmp_path, 8, name="disk")
    host = _store(tmp_path, 1, name="host", demote_to=disk)
    host.put(1, _payload(1))
    host.put(2, _payload(2))
    host.path(1).write_bytes(host.path(1).read_bytes()[:-3])
    _age(host, 1, seconds_ago=50)  # the damaged one is the LRU victim
    ev = host.evict_to_budget()
    assert ev.removed == [1] and ev.demoted == [] and not disk.contains(1)


def test_stale_temporary_is_swept_and_fresh_one_kept(tmp_path: Path) -> None:
    s = _store(tmp_path, 2)
    stale, fresh = s.directory / ".tmp-1-dead", s.directory / ".tmp-2-live"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"x")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    assert s.hashes() == []
    assert not stale.exists() and fresh.exists()


def test_two_stores_on_one_directory_share_the_budget(tmp_path: Path) -> None:
    """Two workers of a node: each sees the other's blocks and one sweep keeps the shared budget."""
    a, b = _store(tmp_path, 3), _store(tmp_path, 3)
    for h in (1, 2):
        a.put(h, _payload(h))
        _age(a, h, seconds_ago=100 - h)
    for h in (3, 4):
        b.put(h, _payload(h))
        _age(b, h, seconds_ago=90 - h)
    assert b.get(1) == _payload(1)  # written by a, read by b (and now most recent)
    assert b.evict_to_budget().removed == [2]
    assert sorted(a.hashes()) == [1, 3, 4]

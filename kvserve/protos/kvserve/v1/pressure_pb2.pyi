# ruff: noqa
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class PressureReport(_message.Message):
    __slots__ = ("worker_id", "seq", "total_blocks", "free_blocks", "used_blocks", "cached_evictable_blocks", "swap_blocks_total", "swap_blocks_free", "num_running", "num_waiting", "num_swapped", "tokens_in_flight", "decode_steps", "step_latency_ms", "num_preemptions_total", "prefix_cache_query_tokens_total", "prefix_cache_hit_tokens_total", "num_swaps_total", "num_imports_total", "num_exports_total", "prefill_tokens_total", "host_cache_bytes_used", "host_cache_bytes_capacity", "disk_cache_bytes_used", "disk_cache_bytes_capacity", "host_load_ratio", "disk_load_ratio", "recompute_ms_per_block", "prefix_cache_host_hit_tokens_total", "prefix_cache_disk_hit_tokens_total", "tier_bytes_written_total", "tier_bytes_loaded_total", "tier_load_seconds_total", "tier_spills_dropped_total", "decode_graph_steps_total")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_EVICTABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SWAP_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SWAP_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERY_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_IMPORTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPORTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    HOST_CACHE_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    HOST_CACHE_BYTES_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    DISK_CACHE_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    DISK_CACHE_BYTES_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    HOST_LOAD_RATIO_FIELD_NUMBER: _ClassVar[int]
    DISK_LOAD_RATIO_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_MS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HOST_HIT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_DISK_HIT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TIER_BYTES_WRITTEN_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TIER_BYTES_LOADED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TIER_LOAD_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TIER_SPILLS_DROPPED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DECODE_GRAPH_STEPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    seq: int
    total_blocks: int
    free_blocks: int
    used_blocks: int
    cached_evictable_blocks: int
    swap_blocks_total: int
    swap_blocks_free: int
    num_running: int
    num_waiting: int
    num_swapped: int
    tokens_in_flight: int
    decode_steps: int
    step_latency_ms: float
    num_preemptions_total: int
    prefix_cache_query_tokens_total: int
    prefix_cache_hit_tokens_total: int
    num_swaps_total: int
    num_imports_total: int
    num_exports_total: int
    prefill_tokens_total: int
    host_cache_bytes_used: int
    host_cache_bytes_capacity: int
    disk_cache_bytes_used: int
    disk_cache_bytes_capacity: int
    host_load_ratio: float
    disk_load_ratio: float
    recompute_ms_per_block: float
    prefix_cache_host_hit_tokens_total: int
    prefix_cache_disk_hit_tokens_total: int
    tier_bytes_written_total: int
    tier_bytes_loaded_total: int
    tier_load_seconds_total: float
    tier_spills_dropped_total: int
    decode_graph_steps_total: int
    def __init__(self, worker_id: _Optional[str] = ..., seq: _Optional[int] = ..., total_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., cached_evictable_blocks: _Optional[int] = ..., swap_blocks_total: _Optional[int] = ..., swap_blocks_free: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_swapped: _Optional[int] = ..., tokens_in_flight: _Optional[int] = ..., decode_steps: _Optional[int] = ..., step_latency_ms: _Optional[float] = ..., num_preemptions_total: _Optional[int] = ..., prefix_cache_query_tokens_total: _Optional[int] = ..., prefix_cache_hit_tokens_total: _Optional[int] = ..., num_swaps_total: _Optional[int] = ..., num_imports_total: _Optional[int] = ..., num_exports_total: _Optional[int] = ..., prefill_tokens_total: _Optional[int] = ..., host_cache_bytes_used: _Optional[int] = ..., host_cache_bytes_capacity: _Optional[int] = ..., disk_cache_bytes_used: _Optional[int] = ..., disk_cache_bytes_capacity: _Optional[int] = ..., host_load_ratio: _Optional[float] = ..., disk_load_ratio: _Optional[float] = ..., recompute_ms_per_block: _Optional[float] = ..., prefix_cache_host_hit_tokens_total: _Optional[int] = ..., prefix_cache_disk_hit_tokens_total: _Optional[int] = ..., tier_bytes_written_total: _Optional[int] = ..., tier_bytes_loaded_total: _Optional[int] = ..., tier_load_seconds_total: _Optional[float] = ..., tier_spills_dropped_total: _Optional[int] = ..., decode_graph_steps_total: _Optional[int] = ...) -> None: ...

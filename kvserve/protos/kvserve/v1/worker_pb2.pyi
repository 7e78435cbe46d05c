# ruff: noqa
from kvserve.protos.kvserve.v1 import serving_pb2 as _serving_pb2
from kvserve.protos.kvserve.v1 import pressure_pb2 as _pressure_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union
from kvserve.protos.kvserve.v1.pressure_pb2 import PressureReport as PressureReport

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_DEVICE: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]
TIER_DEVICE: Tier
TIER_HOST: Tier
TIER_DISK: Tier

class WorkerMessage(_message.Message):
    __slots__ = ("seq", "hello", "step_outputs", "pressure", "block_events", "block_snapshot", "ack", "drain_me", "heartbeat", "step", "request_table")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    STEP_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    PRESSURE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_EVENTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    DRAIN_ME_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REQUEST_TABLE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    hello: Hello
    step_outputs: StepOutputs
    pressure: _pressure_pb2.PressureReport
    block_events: BlockEvents
    block_snapshot: BlockSnapshot
    ack: CommandAck
    drain_me: DrainMe
    heartbeat: StepHeartbeat
    step: StepMessages
    request_table: RequestTable
    def __init__(self, seq: _Optional[int] = ..., hello: _Optional[_Union[Hello, _Mapping]] = ..., step_outputs: _Optional[_Union[StepOutputs, _Mapping]] = ..., pressure: _Optional[_Union[_pressure_pb2.PressureReport, _Mapping]] = ..., block_events: _Optional[_Union[BlockEvents, _Mapping]] = ..., block_snapshot: _Optional[_Union[BlockSnapshot, _Mapping]] = ..., ack: _Optional[_Union[CommandAck, _Mapping]] = ..., drain_me: _Optional[_Union[DrainMe, _Mapping]] = ..., heartbeat: _Optional[_Union[StepHeartbeat, _Mapping]] = ..., step: _Optional[_Union[StepMessages, _Mapping]] = ..., request_table: _Optional[_Union[RequestTable, _Mapping]] = ...) -> None: ...

class RequestTable(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[OwnedRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[OwnedRequest, _Mapping]]] = ...) -> None: ...

class OwnedRequest(_message.Message):
    __slots__ = ("request_id", "owner", "owner_key", "prompt_ids", "sampling", "priority", "cache_salt", "num_output_tokens", "resume_token", "resume_request_id", "resume_tenant", "resume_client", "exporting")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    OWNER_KEY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RESUME_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_TENANT_FIELD_NUMBER: _ClassVar[int]
    RESUME_CLIENT_FIELD_NUMBER: _ClassVar[int]
    EXPORTING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    owner: str
    owner_key: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _serving_pb2.SamplingParams
    priority: int
    cache_salt: str
    num_output_tokens: int
    resume_token: str
    resume_request_id: str
    resume_tenant: str
    resume_client: str
    exporting: bool
    def __init__(self, request_id: _Optional[str] = ..., owner: _Optional[str] = ..., owner_key: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_serving_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., num_output_tokens: _Optional[int] = ..., resume_token: _Optional[str] = ..., resume_request_id: _Optional[str] = ..., resume_tenant: _Optional[str] = ..., resume_client: _Optional[str] = ..., exporting: _Optional[bool] = ...) -> None: ...

class StepMessages(_message.Message):
    __slots__ = ("outputs", "events", "pressure")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    PRESSURE_FIELD_NUMBER: _ClassVar[int]
    outputs: StepOutputs
    events: BlockEvents
    pressure: _pressure_pb2.PressureReport
    def __init__(self, outputs: _Optional[_Union[StepOutputs, _Mapping]] = ..., events: _Optional[_Union[BlockEvents, _Mapping]] = ..., pressure: _Optional[_Union[_pressure_pb2.PressureReport, _Mapping]] = ...) -> None: ...

class DrainMe(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class StepHeartbeat(_message.Message):
    __slots__ = ("step_elapsed_s", "step_cpu_s")
    STEP_ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    STEP_CPU_S_FIELD_NUMBER: _ClassVar[int]
    step_elapsed_s: float
    step_cpu_s: float
    def __init__(self, step_elapsed_s: _Optional[float] = ..., step_cpu_s: _Optional[float] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("worker_id", "model_id", "block_size", "total_blocks", "swap_blocks", "max_model_len", "node_id", "address", "incarnation", "last_command_seq", "vocab_size", "has_tokenizer", "tensor_parallel_size", "takes_adds")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SWAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LAST_COMMAND_SEQ_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    TAKES_ADDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model_id: str
    block_size: int
    total_blocks: int
    swap_blocks: int
    max_model_len: int
    node_id: str
    address: str
    incarnation: str
    last_command_seq: int
    vocab_size: int
    has_tokenizer: bool
    tensor_parallel_size: int
    takes_adds: bool
    def __init__(self, worker_id: _Optional[str] = ..., model_id: _Optional[str] = ..., block_size: _Optional[int] = ..., total_blocks: _Optional[int] = ..., swap_blocks: _Optional[int] = ..., max_model_len: _Optional[int] = ..., node_id: _Optional[str] = ..., address: _Optional[str] = ..., incarnation: _Optional[str] = ..., last_command_seq: _Optional[int] = ..., vocab_size: _Optional[int] = ..., has_tokenizer: _Optional[bool] = ..., tensor_parallel_size: _Optional[int] = ..., takes_adds: _Optional[bool] = ...) -> None: ...

class StepOutputs(_message.Message):
    __slots__ = ("decode_step", "outputs", "columns")
    DECODE_STEP_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    decode_step: int
    outputs: _containers.RepeatedCompositeFieldContainer[RequestOutput]
    columns: DecodeColumns
    def __init__(self, decode_step: _Optional[int] = ..., outputs: _Optional[_Iterable[_Union[RequestOutput, _Mapping]]] = ..., columns: _Optional[_Union[DecodeColumns, _Mapping]] = ...) -> None: ...

class DecodeColumns(_message.Message):
    __slots__ = ("request_ids", "counts", "token_ids", "num_output_tokens", "text_deltas")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_DELTAS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    counts: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_output_tokens: _containers.RepeatedScalarFieldContainer[int]
    text_deltas: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., counts: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_output_tokens: _Optional[_Iterable[int]] = ..., text_deltas: _Optional[_Iterable[str]] = ...) -> None: ...

class RequestOutput(_message.Message):
    __slots__ = ("request_id", "new_token_ids", "text_delta", "finish_reason", "num_cached_tokens", "num_prompt_tokens", "num_preemptions", "num_swaps", "error", "num_output_tokens", "logprobs", "owned")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_DELTA_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    OWNED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    text_delta: str
    finish_reason: str
    num_cached_tokens: int
    num_prompt_tokens: int
    num_preemptions: int
    num_swaps: int
    error: str
    num_output_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_serving_pb2.TokenLogprobs]
    owned: bool
    def __init__(self, request_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., text_delta: _Optional[str] = ..., finish_reason: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_swaps: _Optional[int] = ..., error: _Optional[str] = ..., num_output_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_serving_pb2.TokenLogprobs, _Mapping]]] = ..., owned: _Optional[bool] = ...) -> None: ...

class BlockEvents(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[BlockEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[BlockEvent, _Mapping]]] = ...) -> None: ...

class BlockEvent(_message.Message):
    __slots__ = ("seq", "stored", "removed", "cleared")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    stored: BlockStored
    removed: BlockRemoved
    cleared: AllBlocksCleared
    def __init__(self, seq: _Optional[int] = ..., stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("hashes", "tier")
    HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[int]
    tier: Tier
    def __init__(self, hashes: _Optional[_Iterable[int]] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("hashes", "tier")
    HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[int]
    tier: Tier
    def __init__(self, hashes: _Optional[_Iterable[int]] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BlockSnapshot(_message.Message):
    __slots__ = ("seq", "hashes", "host_hashes", "disk_hashes")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    HOST_HASHES_FIELD_NUMBER: _ClassVar[int]
    DISK_HASHES_FIELD_NUMBER: _ClassVar[int]
    seq: int
    hashes: _containers.RepeatedScalarFieldContainer[int]
    host_hashes: _containers.RepeatedScalarFieldContainer[int]
    disk_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq: _Optional[int] = ..., hashes: _Optional[_Iterable[int]] = ..., host_hashes: _Optional[_Iterable[int]] = ..., disk_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class CommandAck(_message.Message):
    __slots__ = ("command_seq", "request_id", "ok", "error", "refusals")
    COMMAND_SEQ_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    command_seq: int
    request_id: str
    ok: bool
    error: str
    refusals: _containers.RepeatedCompositeFieldContainer[AddRefusal]
    def __init__(self, command_seq: _Optional[int] = ..., request_id: _Optional[str] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., refusals: _Optional[_Iterable[_Union[AddRefusal, _Mapping]]] = ...) -> None: ...

class AddRefusal(_message.Message):
    __slots__ = ("request_id", "kind", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kind: str
    message: str
    def __init__(self, request_id: _Optional[str] = ..., kind: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class RouterCommand(_message.Message):
    __slots__ = ("seq", "acked_seq", "abort", "preempt", "request_snapshot", "reown", "add_requests")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ACKED_SEQ_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    PREEMPT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    REOWN_FIELD_NUMBER: _ClassVar[int]
    ADD_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    acked_seq: int
    abort: Abort
    preempt: Preempt
    request_snapshot: RequestSnapshot
    reown: Reown
    add_requests: AddRequests
    def __init__(self, seq: _Optional[int] = ..., acked_seq: _Optional[int] = ..., abort: _Optional[_Union[Abort, _Mapping]] = ..., preempt: _Optional[_Union[Preempt, _Mapping]] = ..., request_snapshot: _Optional[_Union[RequestSnapshot, _Mapping]] = ..., reown: _Optional[_Union[Reown, _Mapping]] = ..., add_requests: _Optional[_Union[AddRequests, _Mapping]] = ...) -> None: ...

class AddRequests(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[AddRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[AddRequest, _Mapping]]] = ...) -> None: ...

class AddRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "sampling", "priority", "cache_salt", "resume_output_ids", "owner", "owner_key", "resume_grant")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    RESUME_OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    OWNER_KEY_FIELD_NUMBER: _ClassVar[int]
    RESUME_GRANT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: WorkerSampling
    priority: int
    cache_salt: str
    resume_output_ids: _containers.RepeatedScalarFieldContainer[int]
    owner: str
    owner_key: str
    resume_grant: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[WorkerSampling, _Mapping]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., resume_output_ids: _Optional[_Iterable[int]] = ..., owner: _Optional[str] = ..., owner_key: _Optional[str] = ..., resume_grant: _Optional[_Iterable[str]] = ...) -> None: ...

class WorkerSampling(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ...) -> None: ...

class Reown(_message.Message):
    __slots__ = ("request_id", "owner")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    owner: _serving_pb2.Owner
    def __init__(self, request_id: _Optional[str] = ..., owner: _Optional[_Union[_serving_pb2.Owner, _Mapping]] = ...) -> None: ...

class Abort(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class Preempt(_message.Message):
    __slots__ = ("request_id", "mode")
    class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        MODE_UNSPECIFIED: _ClassVar[Preempt.Mode]
        RECOMPUTE: _ClassVar[Preempt.Mode]
        SWAP: _ClassVar[Preempt.Mode]
    MODE_UNSPECIFIED: Preempt.Mode
    RECOMPUTE: Preempt.Mode
    SWAP: Preempt.Mode
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    mode: Preempt.Mode
    def __init__(self, request_id: _Optional[str] = ..., mode: _Optional[_Union[Preempt.Mode, str]] = ...) -> None: ...

class RequestSnapshot(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

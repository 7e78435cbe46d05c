# ruff: noqa
from kvserve.protos.kvserve.v1 import pressure_pb2 as _pressure_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "messages", "sampling", "priority", "tenant", "resume")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    messages: ChatMessages
    sampling: SamplingParams
    priority: int
    tenant: str
    resume: ResumeStream
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., tenant: _Optional[str] = ..., resume: _Optional[_Union[ResumeStream, _Mapping]] = ...) -> None: ...

class ResumeStream(_message.Message):
    __slots__ = ("token", "num_tokens", "num_text_chars")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TEXT_CHARS_FIELD_NUMBER: _ClassVar[int]
    token: str
    num_tokens: int
    num_text_chars: int
    def __init__(self, token: _Optional[str] = ..., num_tokens: _Optional[int] = ..., num_text_chars: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("worker_id", "deadline_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    deadline_s: float
    def __init__(self, worker_id: _Optional[str] = ..., deadline_s: _Optional[float] = ...) -> None: ...

class DrainProgress(_message.Message):
    __slots__ = ("worker_id", "phase", "requests_left", "requests_migrated", "requests_handed_off", "elapsed_s", "old_incarnation", "new_incarnation", "reason")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_LEFT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_MIGRATED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_HANDED_OFF_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    OLD_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    NEW_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    phase: str
    requests_left: int
    requests_migrated: int
    requests_handed_off: int
    elapsed_s: float
    old_incarnation: str
    new_incarnation: str
    reason: str
    def __init__(self, worker_id: _Optional[str] = ..., phase: _Optional[str] = ..., requests_left: _Optional[int] = ..., requests_migrated: _Optional[int] = ..., requests_handed_off: _Optional[int] = ..., elapsed_s: _Optional[float] = ..., old_incarnation: _Optional[str] = ..., new_incarnation: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
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

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "logprobs")
    class LogprobsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    logprobs: _containers.ScalarMap[int, float]
    def __init__(self, logprob: _Optional[float] = ..., logprobs: _Optional[_Mapping[int, float]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text_delta", "finish_reason", "usage", "worker_id", "num_preemptions", "num_swaps", "num_migrations", "num_replays", "logprobs", "resume_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_DELTA_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPS_FIELD_NUMBER: _ClassVar[int]
    NUM_MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_REPLAYS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text_delta: str
    finish_reason: str
    usage: Usage
    worker_id: str
    num_preemptions: int
    num_swaps: int
    num_migrations: int
    num_replays: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    resume_token: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text_delta: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., worker_id: _Optional[str] = ..., num_preemptions: _Optional[int] = ..., num_swaps: _Optional[int] = ..., num_migrations: _Optional[int] = ..., num_replays: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., resume_token: _Optional[str] = ...) -> None: ...

class GenerateStreamRequest(_message.Message):
    __slots__ = ("generate", "cancel_request_id", "resume", "take_over", "batch", "timeout_ms", "client", "token_columns", "owner", "resumable")
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    TAKE_OVER_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    RESUMABLE_FIELD_NUMBER: _ClassVar[int]
    generate: GenerateRequest
    cancel_request_id: str
    resume: Resume
    take_over: TakeOver
    batch: GenerateStreamRequests
    timeout_ms: int
    client: str
    token_columns: bool
    owner: Owner
    resumable: ResumeGrant
    def __init__(self, generate: _Optional[_Union[GenerateRequest, _Mapping]] = ..., cancel_request_id: _Optional[str] = ..., resume: _Optional[_Union[Resume, _Mapping]] = ..., take_over: _Optional[_Union[TakeOver, _Mapping]] = ..., batch: _Optional[_Union[GenerateStreamRequests, _Mapping]] = ..., timeout_ms: _Optional[int] = ..., client: _Optional[str] = ..., token_columns: _Optional[bool] = ..., owner: _Optional[_Union[Owner, _Mapping]] = ..., resumable: _Optional[_Union[ResumeGrant, _Mapping]] = ...) -> None: ...

class GenerateStreamRequests(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[GenerateStreamRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[GenerateStreamRequest, _Mapping]]] = ...) -> None: ...

class ResumeGrant(_message.Message):
    __slots__ = ("token", "request_id")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    token: str
    request_id: str
    def __init__(self, token: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class TakeOver(_message.Message):
    __slots__ = ("request_id", "token", "owner")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token: str
    owner: Owner
    def __init__(self, request_id: _Optional[str] = ..., token: _Optional[str] = ..., owner: _Optional[_Union[Owner, _Mapping]] = ...) -> None: ...

class Owner(_message.Message):
    __slots__ = ("address", "key")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    address: str
    key: str
    def __init__(self, address: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class Resume(_message.Message):
    __slots__ = ("owner_key", "output_ids")
    OWNER_KEY_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    owner_key: str
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, owner_key: _Optional[str] = ..., output_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateBatch(_message.Message):
    __slots__ = ("responses", "errors", "columns", "placed", "replays")
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    PLACED_FIELD_NUMBER: _ClassVar[int]
    REPLAYS_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[GenerateResponse]
    errors: _containers.RepeatedCompositeFieldContainer[RequestError]
    columns: TokenColumns
    placed: _containers.RepeatedScalarFieldContainer[str]
    replays: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, responses: _Optional[_Iterable[_Union[GenerateResponse, _Mapping]]] = ..., errors: _Optional[_Iterable[_Union[RequestError, _Mapping]]] = ..., columns: _Optional[_Union[TokenColumns, _Mapping]] = ..., placed: _Optional[_Iterable[str]] = ..., replays: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenColumns(_message.Message):
    __slots__ = ("worker_ids", "workers", "request_ids", "counts", "token_ids", "text_deltas")
    WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_DELTAS_FIELD_NUMBER: _ClassVar[int]
    worker_ids: _containers.RepeatedScalarFieldContainer[str]
    workers: _containers.RepeatedScalarFieldContainer[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    counts: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text_deltas: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, worker_ids: _Optional[_Iterable[str]] = ..., workers: _Optional[_Iterable[int]] = ..., request_ids: _Optional[_Iterable[str]] = ..., counts: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., text_deltas: _Optional[_Iterable[str]] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("request_id", "code", "message", "retry_after_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    message: str
    retry_after_ms: int
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., retry_after_ms: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "cached_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class ClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    def __init__(self, interval_ms: _Optional[int] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("workers", "router", "timestamp_ms")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    router: RouterStatus
    timestamp_ms: int
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., router: _Optional[_Union[RouterStatus, _Mapping]] = ..., timestamp_ms: _Optional[int] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "healthy", "usage", "num_migrations_total", "last_report_age_s", "blocks_in_flight", "model_id", "node_id", "state", "restarts_total", "incarnation", "tensor_parallel_size", "report")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_MIGRATIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LAST_REPORT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    healthy: bool
    usage: float
    num_migrations_total: int
    last_report_age_s: float
    blocks_in_flight: int
    model_id: str
    node_id: str
    state: str
    restarts_total: int
    incarnation: str
    tensor_parallel_size: int
    report: _pressure_pb2.PressureReport
    def __init__(self, worker_id: _Optional[str] = ..., healthy: _Optional[bool] = ..., usage: _Optional[float] = ..., num_migrations_total: _Optional[int] = ..., last_report_age_s: _Optional[float] = ..., blocks_in_flight: _Optional[int] = ..., model_id: _Optional[str] = ..., node_id: _Optional[str] = ..., state: _Optional[str] = ..., restarts_total: _Optional[int] = ..., incarnation: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., report: _Optional[_Union[_pressure_pb2.PressureReport, _Mapping]] = ...) -> None: ...

class RouterStatus(_message.Message):
    __slots__ = ("queue_requests", "queue_blocks", "max_queue_requests", "max_queue_blocks", "admission_state", "rejections_total", "requests_in_flight", "projected_wait_s", "replays_total", "high_watermark", "low_watermark")
    class RejectionsTotalEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    QUEUE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_STATE_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PROJECTED_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    REPLAYS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    HIGH_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    LOW_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    queue_requests: int
    queue_blocks: int
    max_queue_requests: int
    max_queue_blocks: int
    admission_state: str
    rejections_total: _containers.ScalarMap[str, int]
    requests_in_flight: int
    projected_wait_s: float
    replays_total: int
    high_watermark: float
    low_watermark: float
    def __init__(self, queue_requests: _Optional[int] = ..., queue_blocks: _Optional[int] = ..., max_queue_requests: _Optional[int] = ..., max_queue_blocks: _Optional[int] = ..., admission_state: _Optional[str] = ..., rejections_total: _Optional[_Mapping[str, int]] = ..., requests_in_flight: _Optional[int] = ..., projected_wait_s: _Optional[float] = ..., replays_total: _Optional[int] = ..., high_watermark: _Optional[float] = ..., low_watermark: _Optional[float] = ...) -> None: ...

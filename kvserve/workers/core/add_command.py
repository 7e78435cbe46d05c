"""``WorkerRequest`` on the WorkerLink: the router's ``AddRequests`` command and the worker's reading of it.

The router adds requests to a worker as one message on the link it already holds (``AddRequests``, acked with
the refusals) instead of a Ray actor call: a call cost the router ~550 us of CPU per dispatch, the message ~150
(``kvserve bench call-cost``; issue 41, router CPU per request). Both ends use this module, so what the worker
runs is what the router resolved, field for field (``request_from_proto(request_proto(r)) == r``: tested).

NOTE: the sampling values travel as doubles (``WorkerSampling``), not as serving.proto's float32 fields: a
temperature an HTTP client sent as 0.7 must reach the sampler as the same double the Ray path pickled.
"""

from __future__ import annotations

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.workers.core.request import WorkerRequest
from kvserve.workers.core.sampling_params import SamplingParams

# NOTE: a command's prompt tokens at most (~5 bytes each on the wire): a burst of long prompts is split into
# several commands, each far below the worker's 64 MiB receive limit (kvserve/workers/transport/worker_link.py).
MAX_COMMAND_TOKENS = 1 << 20


def sampling_proto(params: SamplingParams) -> pb.WorkerSampling:
    msg = pb.WorkerSampling(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    return msg


def sampling_from_proto(msg: pb.WorkerSampling) -> SamplingParams:
    """Raises ValueError (``SamplingParams``' own checks) for values the router would never have sent."""
    return SamplingParams(
        max_tokens=msg.max_tokens,
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
    )


def request_proto(r: WorkerRequest) -> pb.AddRequest:
    """One request of an ``AddRequests`` (token prompts only: the router always tokenizes)."""
    if isinstance(r.prompt, str):
        raise TypeError(f"request {r.request_id}: a worker is sent token ids, not text")
    msg = pb.AddRequest(
        request_id=r.request_id,
        prompt_ids=r.prompt,
        sampling=sampling_proto(r.params),
        priority=r.priority,
        resume_output_ids=r.resume_output_ids,
        owner=r.owner,
        owner_key=r.owner_key,
        resume_grant=r.resume_grant,
    )
    if r.cache_salt is not None:
        msg.cache_salt = r.cache_salt
    return msg


def request_from_proto(msg: pb.AddRequest) -> WorkerRequest:
    """Raises ValueError for sampling values out of range (the worker refuses that request alone)."""
    return WorkerRequest(
        request_id=msg.request_id,
        prompt=tuple(msg.prompt_ids),
        params=sampling_from_proto(msg.sampling),
        priority=msg.priority,
        cache_salt=msg.cache_salt if msg.HasField("cache_salt") else None,
        resume_output_ids=tuple(msg.resume_output_ids),
        owner=msg.owner,
        owner_key=msg.owner_key,
        resume_grant=tuple(msg.resume_grant),
    )


def add_commands(requests: list[WorkerRequest]) -> list[pb.AddRequests]:
    """``requests`` as one ``AddRequests`` or, past ``MAX_COMMAND_TOKENS`` of prompts, several (in order)."""
    commands: list[pb.AddRequests] = []
    current, tokens = pb.AddRequests(), 0
    for r in requests:
        n = len(r.prompt) + len(r.resume_output_ids)
        if current.requests and tokens + n > MAX_COMMAND_TOKENS:
            commands.append(current)
            current, tokens = pb.AddRequests(), 0
        current.requests.append(request_proto(r))
        tokens += n
    if current.requests:
        commands.append(current)
    return commands

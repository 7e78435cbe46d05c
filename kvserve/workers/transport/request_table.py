"""The ``RequestTable`` a worker sends the router after every connect (docs/architecture.md section 2a).

A restarted router knows nothing of the requests a worker runs for owners (frontends): the table lets it
adopt them (placement, supervision, replay) while their tokens keep flowing to the owners.

NOTE: a leaf module (protos and dataclasses only): the worker builds the table on its engine thread.
"""

from __future__ import annotations

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.request import Request


def sampling_proto(params: SamplingParams) -> spb.SamplingParams:
    """``params`` as the wire's ``SamplingParams``, which the router's ``sampling_params`` reads back equal.

    Contract: ``max_tokens`` is the resolved budget (never 0, "server default"); the optional fields are
    set only when on (``top_p`` != 1.0, a ``seed``, ``logprobs``), as a client would send them.
    """
    msg = spb.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
    )
    if params.top_p != 1.0:
        msg.top_p = params.top_p
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    return msg


def owned_request_proto(
    req: Request, owner: tuple[str, str], grant: tuple[str, ...] = (), exporting: bool = False
) -> pb.OwnedRequest:
    """One live owned request as the table lists it: its dispatch id on this worker, its owner
    ``(address, key)``, what it runs (prompt, sampling, priority, tenant), how far it got, its resume
    ``grant`` (token, client's request id, tenant, end client; () for none), and whether it is paused for a
    migration (``exporting``)."""
    address, key = owner
    token, client_rid, tenant, client = grant if len(grant) == 4 else ("", "", "", "")
    return pb.OwnedRequest(
        request_id=req.request_id,
        owner=address,
        owner_key=key,
        prompt_ids=req.prompt_token_ids,
        sampling=sampling_proto(req.sampling_params),
        priority=req.priority,
        cache_salt=req.cache_salt or "",
        num_output_tokens=req.num_output_tokens,
        resume_token=token,
        resume_request_id=client_rid,
        resume_tenant=tenant,
        resume_client=client,
        exporting=exporting,
    )

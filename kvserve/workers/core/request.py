"""``WorkerRequest``: the one message a request enters a worker as (after vLLM's ``EngineCoreRequest``)."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.workers.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class WorkerRequest:
    """A request for one worker's engine.

    Attributes:
        request_id: the id on that worker (the router's dispatch id, ``<request_id>#<dispatch>``).
        prompt: prompt token ids, or text the worker tokenizes (offline use).
        params: sampling parameters.
        priority: larger runs first when the worker must preempt.
        cache_salt: isolates the prefix cache (the tenant); None shares it.
        resume_output_ids: output tokens the client already has (a failover replay continues after
            them: the worker rebuilds text and stop state and fast-forwards the seeded RNG).
        owner: address of the data service its outputs go to (a frontend's, docs/architecture.md
            section 2a); "" = the router's WorkerLink, as every request before owners.
        owner_key: the owner's key for the request (its outputs there are ``<owner_key>#<dispatch>``).
        resume_grant: (token, the client's request id, tenant, end client) a client's resume through another
            frontend must match (kvserve/router/requests/takeover.py), or () for none. The worker only keeps
            it and lists it in its ``RequestTable``, so a restarted router can still honour the resume.
    """

    request_id: str
    prompt: tuple[int, ...] | str
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    resume_output_ids: tuple[int, ...] = ()
    owner: str = ""
    owner_key: str = ""
    resume_grant: tuple[str, ...] = ()

"""Placement as configuration: ``RouterConfig.placement_scorers`` names registered scorers and their
weights (kvserve/router/policy/placement/scorers/__init__.py ``SCORERS``), reaches the router's
``Placement`` and changes where a request goes; bad specs are refused at start-up with their name."""

from __future__ import annotations

import math

import pytest

from kvserve.router.config import RouterConfig
from kvserve.router.policy.placement import Placement, PlacementRequest, WorkerView
from kvserve.router.policy.placement.cost import CostModel
from kvserve.router.policy.placement.scorers import SCORERS, default_weights, parse_weights
from kvserve.router.requests.router import Router

BS = 4
PREFIX = tuple(range(100, 151))  # 51 blocks


def view(worker_id: str, **kw) -> WorkerView:
    return WorkerView(worker_id=worker_id, healthy=True, block_size=BS, total_blocks=512, free_blocks=500, **kw)


def request() -> PlacementRequest:
    return PlacementRequest(len(PREFIX) * BS + 1, PREFIX, 16)


def cached_on_a(worker_id: str, hashes: tuple[int, ...]) -> int:
    return 51 if worker_id == "a" else 0


def test_the_spec_parses_into_registered_names_and_weights() -> None:
    assert parse_weights("prefix_affinity=3, backlog=1,migration_load=0.25") == {
        "prefix_affinity": 3.0, "backlog": 1.0, "migration_load": 0.25,
    }  # fmt: skip
    for bad, words in [("prefix_afinity=1", "NAME one of"), ("backlog", "NAME=WEIGHT"), ("backlog=x", "not a number"),
                       ("backlog=-1", ">= 0"), ("backlog=nan", ">= 0"), ("backlog=1,backlog=2", "twice"),
                       ("", "NAME=WEIGHT")]:  # fmt: skip
        with pytest.raises(ValueError, match=words):
            parse_weights(bad)


def test_the_default_set_is_the_cost_models() -> None:
    cost = CostModel()
    assert default_weights(cost) == {"prefix_affinity": cost.overlap_weight, "backlog": 1.0,
                                     "pool_usage": cost.usage_weight}  # fmt: skip
    assert set(default_weights(cost)) <= set(SCORERS)
    explicit = Placement(weights=default_weights(cost))
    assert [(type(s), w) for s, w in explicit.scorers] == [(type(s), w) for s, w in Placement().scorers]


def test_the_router_config_refuses_a_bad_spec_at_start_up() -> None:
    with pytest.raises(ValueError, match="placement scorer 'nope=1'"):
        RouterConfig(placement_scorers="nope=1")
    with pytest.raises(ValueError, match="kv_aware policy only"):
        Router(RouterConfig(placement_policy="round_robin", placement_scorers="backlog=1"))


def test_configured_weights_change_where_a_request_goes() -> None:
    """A cached prefix on a busier "a": the default weights keep the request with its cache; a set
    without affinity sends it to the idle "b"."""
    workers = [view("a", running=10, blocks_in_flight=20), view("b")]
    default = Router(RouterConfig())
    load_only = Router(RouterConfig(placement_scorers="backlog=1,pool_usage=0.5"))
    assert default.placement.decide(request(), workers, cached_on_a).worker_id == "a"
    assert load_only.placement.decide(request(), workers, cached_on_a).worker_id == "b"


def test_a_scorer_outside_the_default_set_is_reachable_by_its_weight() -> None:
    """``migration_load`` (weight 0 by default): on, a worker copying a migration's blocks is avoided."""
    workers = [view("a", blocks_migrating_in=40), view("b", running=2)]
    without = Placement(weights=parse_weights("backlog=1"))
    with_it = Placement(weights=parse_weights("backlog=1,migration_load=1"))
    assert without.decide(request(), workers, lambda w, h: 0).worker_id == "a"
    assert with_it.decide(request(), workers, lambda w, h: 0).worker_id == "b"
    assert not math.isnan(sum(w for _, w in with_it.scorers))

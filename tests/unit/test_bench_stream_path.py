"""`python -m kvserve.cluster.bench.stream_path`: the router's in-process streaming path delivers every token
it times, and reports a per-token figure scripts can read."""

from __future__ import annotations

import json

import pytest

from kvserve.cluster.bench import stream_path


def test_every_token_is_streamed_and_the_figure_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    assert stream_path.main(["--streams", "8", "--workers", "2", "--steps", "5", "--repeats", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["router_python_us_per_token_median"] > 0 and len(result["runs"]) == 1


def test_a_path_that_drops_tokens_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserve.router.requests.router import Router

    monkeypatch.setattr(Router, "_on_output", lambda self, worker_id, out, now=None: None)
    with pytest.raises(RuntimeError, match="streamed 0 tokens"):
        stream_path.main(["--streams", "4", "--steps", "3", "--repeats", "1"])

"""Swap corner cases the end-to-end parity runs rarely reach."""

from __future__ import annotations

from pathlib import Path

from kvserve.workers.core.request import WorkerRequest
from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.engine import LLM

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def test_swap_out_in_a_step_that_schedules_nothing(tiny_llama_dir: Path) -> None:
    """A paused export holds half the pool; the only running request cannot grow, preempts
    itself by swap, and the step runs nothing. Its blocks must still reach host memory."""
    prompt_a, prompt_b = list(range(100, 110)), list(range(200, 214))
    (expected,) = [
        o.token_ids for o in LLM(str(tiny_llama_dir), block_size=4, num_gpu_blocks=64).generate([prompt_a], GREEDY)
    ]
    llm = LLM(
        str(tiny_llama_dir), block_size=4, num_gpu_blocks=8, preemption_mode="swap", swap_space=0.01,
        watermark=0.0,
    )  # fmt: skip
    engine = llm.engine
    engine.add_request(WorkerRequest("b", prompt_b, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)))
    engine.step()
    assert engine.export_request("b") is not None  # paused: keeps its 4 blocks
    engine.add_request(WorkerRequest("a", prompt_a, GREEDY))
    tokens: list[int] = []
    empty_step_with_swap = False
    for _ in range(200):
        outputs = engine.step()
        tokens += [t for o in outputs for t in o.new_token_ids]
        engine.check_integrity()
        if engine.scheduler.swapped and not engine.scheduler.running and "b" in engine.exporting:
            empty_step_with_swap = empty_step_with_swap or not outputs
            engine.finish_export("b", migrated=True)  # frees b's blocks: a can come back
        if not engine.has_unfinished_requests():
            break
    assert empty_step_with_swap, "the scenario did not happen: fix the test setup"
    assert engine.scheduler.num_preemptions["swap"] >= 1
    assert tokens == expected
    assert engine.pool.stats().used == 0 and engine.swap_pool is not None
    assert engine.swap_pool.num_free_blocks == engine.swap_pool.num_blocks

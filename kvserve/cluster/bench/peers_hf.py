"""Peer script: HF transformers' continuous-batching ``generate_batch`` on the bench workload.

Runs in the peer's venv and speaks ``peers_protocol``. fp32, greedy, no EOS (``eos_token_id=-1``: every
request runs to ``max_tokens``, as ``ignore_eos`` does in the other engines). It cannot cap how many requests
run at once: a ``max_num_seqs`` below the number of prompts (one that would bind) is refused.
"""

from __future__ import annotations

from peers_protocol import load_spec, serve


def main() -> None:
    spec = load_spec()
    model_dir, prompt_ids, max_tokens = spec.model, spec.prompt_ids, spec.max_tokens
    cap = spec.engine.pop("max_num_seqs", None)
    if spec.engine or (cap is not None and int(cap) < len(prompt_ids)):
        raise SystemExit(f"hf peer: cannot apply engine settings {dict(spec.engine, max_num_seqs=cap)} "
                         f"(generate_batch runs all {len(prompt_ids)} prompts at once)")  # fmt: skip
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    model.generate_batch(prompt_ids[:1], generation_config=config)  # warm-up

    def generate() -> list[list[int]]:
        out = model.generate_batch(prompt_ids, generation_config=config)
        # NOTE: results are keyed "req_<input index>"; sort numerically back into input order.
        keys = sorted(out, key=lambda k: int(k.rsplit("_", 1)[-1]))
        return [list(out[k].generated_tokens) for k in keys]

    serve("hf", transformers.__version__, generate)


if __name__ == "__main__":
    main()

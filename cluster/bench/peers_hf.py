"""Peer script: HF transformers' continuous-batching ``generate_batch`` on the bench workload.

Runs in the peer's venv and speaks ``peers_protocol``. fp32, greedy, no EOS (``eos_token_id=-1``: every
request runs to ``max_tokens``, as ``ignore_eos`` does in the other engines).
"""

from __future__ import annotations

from peers_protocol import parse_args, serve


def main() -> None:
    model_dir, prompt_ids, max_tokens = parse_args()
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

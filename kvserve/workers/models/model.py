"""Llama-family forward (Llama 2/3, Mistral, Qwen2, Qwen3) over a paged KV cache.

Batched tensors throughout: a step is one flat token batch ``[num_tokens, hidden]`` with no
per-token Python. Projections are fused (q|k|v, gate|up) so each layer runs two big GEMMs
instead of five small ones; the loader splices the HF weights in. The residual stream is carried as vLLM
carries it: each residual add is fused into the RMSNorm after it, and SiLU-and-mul is one op (one launch
each on CUDA: ``kernels.norm_act``). On CPU, ``pack_for_cpu`` moves the
projections to oneDNN (``Linear``) and greedy rows skip the fp32 logits (``ScreenedArgmax``).
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from kvserve import kernels
from kvserve.kernels import cpu_backend
from kvserve.kernels.reference import apply_rope
from kvserve.workers.core.env_switches import env_switch
from kvserve.workers.engine.attention_metadata import AttentionMetadata
from kvserve.workers.host import cpu_features
from kvserve.workers.host.path_choice import fastest, once_per_process
from kvserve.workers.models import cpu_gemm
from kvserve.workers.models.model_config import ModelConfig

logger = logging.getLogger(__name__)


class Linear(nn.Linear):
    """``nn.Linear`` whose weight can be repacked once for a faster CPU GEMM (``pack_for_cpu``): the
    packing (kvserve's C++ GEMM or oneDNN's) is chosen by timing on this machine (``cpu_gemm``). The
    packed weight replaces the plain one, so memory does not grow."""

    packing: str | None = None
    dense_from_rows: int | None = None  # ``onednn``: from this many rows on, MKL on the plain weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packing is None:
            return nn.functional.linear(x, self.weight, self.bias)
        return cpu_gemm.linear(x, self.weight, self.packing, self.out_features, self.bias, self.dense_from_rows)

    def plain_weight(self) -> torch.Tensor:  # [out_features, in_features]
        """The weight in its plain layout, whatever the packing (bit-exact)."""
        if self.packing is None:
            return self.weight.detach()
        return cpu_gemm.unpack(self.weight.detach(), self.packing, self.out_features)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        # A state dict holds plain weights: it can be saved, compared or loaded anywhere.
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.plain_weight()

    def pack_for_cpu(self, choice: cpu_gemm.GemmChoice) -> None:
        """Repack the weight as ``choice`` says (idempotent)."""
        if self.packing is not None:
            return
        self.weight = nn.Parameter(cpu_gemm.pack(self.weight.detach(), choice.packing), requires_grad=False)
        self.packing, self.dense_from_rows = choice.packing, choice.dense_from_rows


def onednn_linear_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``Linear.pack_for_cpu`` applies: CPU, fp32 (or bf16 with AVX512-BF16), oneDNN built in."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise") or not env_switch("KVSERVE_ONEDNN"):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_features.current().native_bf16_gemm)


class RMSNorm(nn.Module):
    """HF's RMSNorm (statistics in fp32, cast back, times the weight), run by the kernel backend: one
    launch on CUDA, HF's own torch ops on CPU (``kernels.norm_act_reference``).

    ``norm(x)`` returns the normed ``x``. ``norm(x, residual)`` is vLLM's fused residual add: it returns
    ``(norm(x + residual), x + residual)`` and may overwrite ``x`` and ``residual`` (callers drop them).
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        backend = kernels.get_backend(x.device)
        if residual is None:
            return backend.rms_norm(x, self.weight, self.eps)
        return backend.fused_add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], with the checkpoint's rope scaling applied (as HF does)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope = config.rope
    if config.rope_type == "linear":
        inv_freq = inv_freq / rope["factor"]
    elif config.rope_type == "llama3":
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old_len = rope["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding from a precomputed cos/sin table indexed by position."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(config))
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        # sin with its first half negated: rotate_half(x) * sin == roll(x, half) * signed_sin, exactly.
        sin = emb.sin()
        self.register_buffer("signed_sin", torch.cat((-sin[:, : sin.shape[1] // 2], sin[:, sin.shape[1] // 2 :]), 1),
                             persistent=False)  # fmt: skip

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of each position, ``[num_tokens, 1, head_dim]`` (once per forward)."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.signed_sin[positions].to(dtype).unsqueeze(1)

    apply = staticmethod(apply_rope)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.qkv_proj = Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(config.q_size, config.hidden_size, bias=False)
        # Qwen3: each q and k head is RMS-normalised over head_dim (its own weights) before rope.
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.scale = config.head_dim**-0.5
        # Per-tensor fp8 KV scales (checkpoint ``self_attn.k_scale``/``v_scale``; 1.0 without): the cache
        # holds k / k_scale and v / v_scale. Applied only to fp8 caches (the loader sets them).
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # RotaryEmbedding.table of this batch's positions
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn: AttentionMetadata,
        kv_scales: torch.Tensor | None = None,  # int8 caches: [2, num_blocks, block_size, num_kv_heads]
    ) -> torch.Tensor:
        c = self.config
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        backend = kernels.get_backend(x.device)
        scale, v_scale = self.scale, 1.0
        fp8_scaled = kv_cache.dtype == torch.float8_e4m3fn and (self.k_scale != 1.0 or self.v_scale != 1.0)
        if self.q_norm is None and not fp8_scaled:
            # The common case: rope and the KV store in one backend call (one C++ pass on CPU).
            q, _, _ = backend.rope_store_kv(
                qkv, *rope, kv_cache, attn.slot_mapping, c.num_heads, c.num_kv_heads, kv_scales=kv_scales
            )
        else:
            # q and k rotate together: one pass over [num_tokens, num_heads + num_kv_heads, head_dim].
            qk = qkv[:, : c.q_size + c.kv_size].view(num_tokens, -1, c.head_dim)
            if self.q_norm is not None and self.k_norm is not None:
                q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
                qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
            qk = RotaryEmbedding.apply(qk, *rope)
            q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
            v = qkv[:, c.q_size + c.kv_size :].view(num_tokens, c.num_kv_heads, c.head_dim)
            if fp8_scaled:
                # q . (k_scale * k8) = k_scale * (q . k8); sum p (v_scale * v8) = v_scale * sum p v8.
                k, v = k / self.k_scale, v / self.v_scale
                scale, v_scale = scale * self.k_scale, self.v_scale
            backend.store_kv(k, v, kv_cache, attn.slot_mapping, kv_scales=kv_scales)
        num_decode = attn.num_decode_tokens
        window = c.sliding_window
        parts = []
        if num_decode:
            parts.append(backend.decode_attention(
                q[:num_decode], kv_cache, attn.decode_block_tables, attn.decode_context_lens, scale, window,
                kv_scales=kv_scales,
            ))  # fmt: skip
        if num_decode < num_tokens:
            parts.append(backend.prefill_attention(
                q[num_decode:], kv_cache, attn.prefill_block_tables, attn.prefill_cu_seqlens_q,
                attn.prefill_context_lens, scale, window, kv_scales=kv_scales,
            ))  # fmt: skip
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        if v_scale != 1.0:
            out = out * v_scale
        return self.o_proj(out.reshape(num_tokens, c.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate]
        return self.down_proj(kernels.get_backend(x.device).silu_and_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: the previous layer's MLP output (layer 0: the embeddings)
        residual: torch.Tensor | None,  # [num_tokens, hidden]: the residual stream before x (layer 0: None)
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        attn: AttentionMetadata,
        kv_scales: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (this layer's MLP output, the residual stream before it)
        """HF's ``h = h + attn(norm(h)); h = h + mlp(norm(h))`` with the residual carried as vLLM does:
        each add is fused into the norm after it, so the stream is ``x + residual`` between layers. ``x``
        and ``residual`` may be overwritten."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, kv_cache, attn, kv_scales)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class CausalLM(nn.Module):
    """The whole model. ``forward`` returns pre-norm hidden states for every token;
    ``compute_logits`` runs the final norm and LM head only on the rows that get sampled."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, max_positions)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self._onednn = False  # set by pack_for_cpu
        self.cpu_weights = "fp32"  # EngineConfig.cpu_weights, read by pack_for_cpu
        self.gemm_choice: cpu_gemm.GemmChoice | None = None  # set by pack_for_cpu
        self._screen: ScreenedArgmax | None = None
        self._lm_head_packed: torch.Tensor | None = None  # oneDNN-packed LM head where no screen runs
        self._lm_head_cpu: torch.Tensor | None = None  # the C++ kernels' packed LM head (cpu_backend.pack_weight)
        # Where both exact greedy heads apply: timed batch size -> whether the screen won there (measured).
        self._screen_wins: dict[int, bool] | None = None

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn: AttentionMetadata,
        kv_scales: list[torch.Tensor | None] | None = None,  # per layer, int8 caches only (KVCache.layer_scales)
    ) -> torch.Tensor:  # [num_tokens, hidden]
        x = self.embed_tokens(input_ids)
        rope = self.rotary.table(positions, x.dtype)
        scales = kv_scales if kv_scales is not None else [None] * len(kv_caches)
        residual = None
        for layer, kv_cache, layer_scales in zip(self.layers, kv_caches, scales, strict=True):
            x, residual = layer(x, residual, rope, kv_cache, attn, layer_scales)
        # NOTE: the last residual add stays out of the final norm: only the sampled rows get normed.
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab] float32
        return self._lm_head(self.norm(hidden)).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> list[int]:
        """``compute_logits(hidden).argmax(-1)`` (ties -> lowest id)."""
        return self.greedy_token_ids(hidden).tolist()

    def greedy_token_ids(self, hidden: torch.Tensor) -> torch.Tensor:  # [n] int64 on hidden's device
        """``greedy_tokens`` left on the device (no host sync on CUDA: a decode graph captures it)."""
        hidden = self.norm(hidden)
        if self._screen is not None and self._screen_pays(hidden.shape[0]):
            tokens = self._screen(hidden)
            if tokens is not None:
                return tokens
        if self._lm_head_cpu is not None:
            return cpu_backend.lm_head_argmax(hidden, self._lm_head_cpu, self.config.vocab_size)
        return argmax_rows(self._lm_head(hidden))

    def _lm_head_weight(self) -> torch.Tensor:  # [vocab, hidden]
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def _lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._lm_head_cpu is not None:
            return cpu_backend.packed_linear(hidden, self._lm_head_cpu, self.config.vocab_size)
        if self._onednn:
            weight = self._lm_head_packed if self._lm_head_packed is not None else self._lm_head_weight()
            return torch.ops.mkldnn._linear_pointwise(hidden, weight, None, "none", [], "")
        return nn.functional.linear(hidden, self._lm_head_weight())

    def cpu_gemm_summary(self) -> str:
        """Which GEMM the projections and the LM head run (for the log), e.g. ``projections: kvserve
        packed up to 128 rows, MKL above; LM head: kvserve packed``."""
        choice = self.gemm_choice
        if choice is None:
            layers = "torch default"
        elif choice.packing == "kvserve":
            layers = f"kvserve packed up to {cpu_gemm.PACKED_MAX_ROWS} rows, MKL above"
        elif choice.packing == cpu_gemm.BF16_PACKING:
            layers = f"kvserve packed bf16 weights up to {cpu_gemm.PACKED_MAX_ROWS} rows, MKL (fp32 of them) above"
        elif choice.dense_from_rows is not None:
            layers = f"oneDNN packed below {choice.dense_from_rows} rows, MKL from there"
        else:
            layers = "oneDNN packed"
        if choice is not None:
            timed = ", ".join(f"{k} {v * 1e6:.1f} us/token" for k, v in choice.seconds_per_token.items())
            layers += f" ({choice.reason}{': ' + timed if timed else ''})"
        if self._screen is not None and self._screen_wins is not None:
            head = f"measured per batch size: {self._screen_wins} (True = bf16 screen, else kvserve packed)"
        elif self._screen is not None:
            head = f"{self._screen.__class__.__name__} (bf16 screen)"
        elif self._lm_head_cpu is not None:
            head = "kvserve packed" + (" bf16 weights" if self._lm_head_cpu.dtype == torch.bfloat16 else "")
        else:
            head = "oneDNN packed" if self._lm_head_packed is not None else "torch default"
        return f"projections: {layers}; LM head: {head}"

    # Greedy batch sizes at which the two exact LM heads are timed: a server's per-worker batch, an offline one.
    HEAD_TIMING_ROWS = (8, 64)

    def _choose_greedy_head(self, weight: torch.Tensor) -> None:
        """Both exact greedy LM heads apply (the bf16 screen and the C++ packed GEMM's argmax): time them
        at ``HEAD_TIMING_ROWS`` and keep what wins, per batch size (kvserve/workers/host/path_choice.py). A head
        that wins nowhere is dropped (its packed copy would only cost memory)."""
        screen, packed = self._screen, cpu_backend.pack_weight(weight)
        assert screen is not None
        vocab = self.config.vocab_size

        def timed() -> dict[int, str]:
            generator = torch.Generator().manual_seed(0)
            wins = {}
            for rows in self.HEAD_TIMING_ROWS:
                hidden = torch.randn(rows, weight.shape[1], generator=generator)
                winner, times = fastest({
                    "kvserve": lambda h=hidden: cpu_backend.lm_head_argmax(h, packed, vocab),
                    "screen": lambda h=hidden: screen(h),
                })  # fmt: skip
                wins[rows] = winner
                logger.info("greedy LM head at %d rows: kvserve %.2f ms, bf16 screen %.2f ms", rows,
                            times["kvserve"] * 1e3, times["screen"] * 1e3)  # fmt: skip
            return wins

        key = ("greedy_head", tuple(weight.shape), str(weight.dtype), vocab, torch.get_num_threads())
        wins = once_per_process(key, timed)
        if all(w == "screen" for w in wins.values()):
            return
        self._lm_head_cpu = packed
        if all(w == "kvserve" for w in wins.values()):
            self._screen = None
        else:
            self._screen_wins = {rows: w == "screen" for rows, w in wins.items()}

    def _screen_pays(self, rows: int) -> bool:
        """Whether the screen won at the timed batch size nearest ``rows`` (always, where it was not timed)."""
        if self._screen_wins is None:
            return True
        nearest = min(self._screen_wins, key=lambda timed: abs(math.log2(timed) - math.log2(max(rows, 1))))
        return self._screen_wins[nearest]

    def pack_for_cpu(self) -> bool:
        """Repack the layers' projections for oneDNN (see ``Linear``) and set up the greedy screen
        (see ``ScreenedArgmax``). False where oneDNN does not apply."""
        if self._onednn:  # packed already (a second runner over the same model)
            return True
        weight = self.embed_tokens.weight
        if not onednn_linear_supported(weight.device, weight.dtype):
            return False
        projections = [m for m in self.layers.modules() if isinstance(m, Linear)]
        first_layer = [m.weight for m in self.layers[0].modules() if isinstance(m, Linear)]
        self.gemm_choice = cpu_gemm.choose(first_layer, cpu_weights=self.cpu_weights)
        for module in projections:
            module.pack_for_cpu(self.gemm_choice)
        self._onednn = True
        weight = self._lm_head_weight().detach()
        if self.gemm_choice.packing == cpu_gemm.BF16_PACKING:
            # NOTE: the LM head streams bf16 too (the largest GEMM of a decode step); logits, logprobs and
            # greedy ids all come from it, so they agree with one another. The embedding stays fp32.
            self._lm_head_cpu = cpu_backend.pack_weight(weight, torch.bfloat16)
            return True
        self._screen = ScreenedArgmax.build(self._lm_head_weight())
        if self._screen is not None and cpu_backend.packed_gemm_available(weight):
            self._choose_greedy_head(weight)
        elif self._screen is None and cpu_backend.packed_gemm_available(weight):
            # NOTE: the C++ LM head (kvserve/kernels/csrc/cpu_ops.cpp) beats oneDNN's packed GEMM on its shapes,
            # and its argmax never writes the logits: AVX2-only Zen 3, 2 threads, greedy 64 x 256 x 32000
            # at 173 GFLOP/s against 129 for oneDNN + argmax (64 x 576 x 49152: 172 against 134). The
            # plain weight stays (the embedding, a tied head, reads it): vocab x hidden more memory.
            self._lm_head_cpu = cpu_backend.pack_weight(weight)
        elif self._screen is None:
            # NOTE: without the screen nothing reads fp32 rows of the LM head, so it is packed too: on
            # an AVX2-only Zen 3, 64 x 256 x 32000 runs at 142 GFLOP/s packed against 113 plain (oneDNN)
            # and 88 (MKL). A tied head keeps its plain weight for the embedding lookups, so its packed
            # copy costs vocab x hidden more memory; an untied one is repacked in place.
            self._lm_head_packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
            if self.lm_head is not None:
                self.lm_head.weight = nn.Parameter(self._lm_head_packed, requires_grad=False)
        return True


class ScreenedArgmax:
    """Exact greedy argmax of ``hidden @ weight.T`` (fp32) from a bf16 screen plus an fp32 check.

    The LM head is the largest GEMM of a decode step (``vocab x hidden``) while greedy decoding needs
    one id per row. So: (1) compute every logit with a bf16 GEMM (twice the fp32 speed with
    AVX512-BF16), (2) keep the columns whose bf16 logit is within twice a proven error bound of the
    row's bf16 maximum, (3) recompute just those in fp32 and take the argmax (lowest id on ties).

    NOTE (why it is exact): rounding both operands to bf16 (unit roundoff u = 2^-8), accumulating in
    fp32 and rounding the result to bf16 moves a logit by at most ``(3u + 3u^2 + 2 gamma_K) sum|h_i w_i|``
    from its fp32 value (gamma_K = K 2^-24, counted twice: the screen's sum and the fp32 logit's own),
    and ``sum|h_i w_i| <= |h| max_j |w_j|``; we use ``B = 4u |h| max_j |w_j|`` (valid for K <= 2^14).
    Then the fp32 argmax j* has ``bf16_j* >= fp32_j* - B >= fp32_k - B >= bf16_k - 2B`` for every k:
    it is never screened out. A batch whose screen keeps too many columns falls back to the full GEMM.
    """

    GROUP = 128  # columns per group of the two-level candidate search
    MAX_CANDIDATES_PER_ROW = 256

    def __init__(self, weight: torch.Tensor) -> None:
        vocab, hidden = weight.shape
        self.weight = weight  # [vocab, hidden] fp32, plain
        self.vocab = vocab
        self.pad = -vocab % self.GROUP  # zero rows up to whole groups; their columns are masked below
        padded = torch.cat((weight, weight.new_zeros(self.pad, hidden))).to(torch.bfloat16)
        self.weight_bf16 = torch.ops.mkldnn._reorder_linear_weight(padded, 64)  # oneDNN-packed
        self.max_row_norm = float(weight.norm(dim=1).max())

    @classmethod
    def build(cls, weight: torch.Tensor) -> ScreenedArgmax | None:
        """The screen for this LM head weight, or None where it would not pay (or not be exact)."""
        usable = (
            weight.device.type == "cpu"
            and weight.dtype == torch.float32
            and weight.shape[1] <= 2**14
            and cpu_features.current().native_bf16_gemm  # NOTE: the ISA oneDNN may use, not just the hardware
            and env_switch("KVSERVE_GREEDY_SCREEN")
        )
        return cls(weight.detach()) if usable else None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor | None:  # [n] int64, or None: fall back
        n, g = hidden.shape[0], self.GROUP
        approx = torch.ops.mkldnn._linear_pointwise(hidden.to(torch.bfloat16), self.weight_bf16, None, "none", [], "")
        if self.pad:
            approx[:, self.vocab :] = float("-inf")
        groups = approx.view(n, -1, g)  # [n, vocab / g, g] bf16
        group_max = groups.amax(dim=-1)  # [n, vocab / g]
        bound = 4 * 2.0**-8 * hidden.norm(dim=-1) * self.max_row_norm + 1e-30  # [n]; 1e-30: denormal flushes
        threshold = group_max.amax(dim=-1).float() - 2 * bound  # [n]
        if not bool(threshold.isfinite().all()):
            return None
        # Candidate groups, then candidate columns inside them: no pass over [n, vocab] but the max.
        grow, gcol = (group_max >= threshold.unsqueeze(1)).nonzero(as_tuple=True)
        candidates = groups.view(-1, g).index_select(0, grow * groups.shape[1] + gcol)  # [groups kept, g]
        pi, pj = (candidates >= threshold[grow].unsqueeze(1)).nonzero(as_tuple=True)
        if pi.numel() > self.MAX_CANDIDATES_PER_ROW * n:
            return None
        rows, cols = grow[pi], gcol[pi] * g + pj  # sorted by row, then column
        # fp32 logits of the candidates (index_select: one row memcpy each)
        exact = (hidden.index_select(0, rows) * self.weight.index_select(0, cols)).sum(dim=-1)
        best = torch.full((n,), float("-inf"), device=hidden.device).scatter_reduce(0, rows, exact, "amax")
        top = exact == best[rows]
        return torch.full((n,), self.vocab, device=hidden.device).scatter_reduce(0, rows[top], cols[top], "amin")


def argmax_rows(x: torch.Tensor, chunk: int = 128) -> torch.Tensor:  # [n] int64
    """``x.argmax(-1)`` for ``[n, vocab]`` (first index on ties), in three cheap passes.

    NOTE: torch's CPU argmax is scalar code (0.55 ms for 64 x 32000) where amax is vectorised (0.05 ms):
    take the max of each 128-column chunk, the first chunk holding the row maximum, then the argmax
    inside that one chunk.
    """
    n, vocab = x.shape
    if x.device.type != "cpu" or vocab % chunk:
        return x.argmax(dim=-1)
    chunks = x.view(n, vocab // chunk, chunk)
    best = chunks.amax(dim=-1).argmax(dim=-1)  # [n]
    return best * chunk + chunks[torch.arange(n, device=x.device), best].argmax(dim=-1)

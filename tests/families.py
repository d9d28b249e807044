"""The model families the converter supports, each as a tiny random Hugging Face config (built locally, no
network), and transformers' side of the parity tests: its logits and greedy `generate` on left-padded batches.
`FAMILIES` is the one list every per-family test iterates."""

from __future__ import annotations

import numpy as np

# Tiny configs of each supported family; each exercises that family's switches.
_COMMON = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)


FAMILIES: dict[str, dict] = {
    "llama": dict(model_type="llama", rope_theta=10000.0, **_COMMON),
    "llama3_rope": dict(
        model_type="llama",
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
        **_COMMON,
    ),
    "llama_linear_rope_bias": dict(
        model_type="llama",
        rope_scaling=dict(rope_type="linear", factor=2.0),
        attention_bias=True,
        mlp_bias=True,
        **_COMMON,
    ),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True, **_COMMON),
    "qwen3": dict(model_type="qwen3", head_dim=16, **_COMMON),
    "mistral": dict(model_type="mistral", sliding_window=4, head_dim=8, **_COMMON),
    "llama_yarn": dict(
        model_type="llama",
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=8.0),
        **_COMMON,
    ),
    # Phi-3: fused qkv_proj / gate_up_proj, a sliding window on every layer.
    "phi3": dict(model_type="phi3", sliding_window=6, pad_token_id=None, **_COMMON),
    # Phi-3.5-style longrope past an original context of 16, with Phi-4-mini's partial rotary (half the dims).
    "phi3_longrope": dict(
        model_type="phi3",
        pad_token_id=None,
        partial_rotary_factor=0.5,
        original_max_position_embeddings=16,
        rope_scaling=dict(rope_type="longrope", short_factor=[1.0, 1.3], long_factor=[2.5, 7.0]),
        **_COMMON,
    ),
    # Gemma 2: (1 + w) norms, sandwich norms, GeGLU, sqrt(d) embeddings, soft caps small enough to bite,
    # query_pre_attn_scalar != head_dim, sliding window 4 on layers 0, 2, ...
    "gemma2": dict(
        model_type="gemma2", head_dim=16, sliding_window=4, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
        final_logit_softcapping=6.0, initializer_range=0.2, **{**_COMMON, "num_hidden_layers": 3},
    ),
    # Gemma 3 (text): q/k norms, local layers (window 5, RoPE base 100) around one global layer (linear-scaled).
    "gemma3": dict(
        model_type="gemma3_text", head_dim=16, sliding_window=5, query_pre_attn_scalar=16, initializer_range=0.2,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], rope_theta=10000.0,
        rope_local_base_freq=100.0, rope_scaling=dict(rope_type="linear", factor=2.0),
        **{**_COMMON, "num_hidden_layers": 3},
    ),
    # Mixtures of experts (8 experts, top 2; routers sharpened by `random_hf_model` so top-k has no near-ties):
    # Qwen3-MoE with renormalized top-k, Qwen2-MoE's shared expert and q/k/v biases, Mixtral's names and window,
    # OLMoE's projection-wide q/k norms.
    "qwen3_moe": dict(model_type="qwen3_moe", head_dim=16, moe_intermediate_size=24, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True, **_COMMON),
    "qwen2_moe": dict(model_type="qwen2_moe", moe_intermediate_size=24, shared_expert_intermediate_size=40,
                      num_experts=8, num_experts_per_tok=2, **_COMMON),
    "mixtral": dict(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2, sliding_window=5, **_COMMON),
    "olmoe": dict(model_type="olmoe", num_experts=8, num_experts_per_tok=2, pad_token_id=0, eos_token_id=None,
                  **_COMMON),
    # gpt-oss: attention sinks, sliding window 4 on layers 0 and 2, YaRN without truncation, a biased router, biased
    # experts with a clamped SwiGLU whose limit (0.3) bites on these activations (beta_slow 0.1: a ramp end that
    # truncation would round, so the flag matters at head_dim 8).
    "gpt_oss": dict(model_type="gpt_oss", head_dim=8, num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
                    swiglu_limit=0.3,
                    rope_scaling=dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=16, beta_fast=8.0,
                                      beta_slow=0.1, truncate=False),
                    **{**_COMMON, "num_hidden_layers": 3, "intermediate_size": 24}),
    # Qwen3.5 (text): a hybrid stack, Gated DeltaNet layers (2 key heads serving 4 value heads, a 4-tap convolution)
    # around the softmax layers (the 4th and 8th: two periods, so the scanned stack loops), those with q/k norms, an
    # output gate and a quarter-rotary; (1 + w) norms. Chunks of 64 tokens: the 40-token rows are one chunk.
    "qwen3_5": dict(model_type="qwen3_5_text", head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                    **{**_COMMON, "num_hidden_layers": 8}),
    # Qwen3.5-MoE (text): the same hybrid stack, every layer 8 experts (top 2, renormalised) and a shared expert.
    "qwen3_5_moe": dict(model_type="qwen3_5_moe_text", head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                        linear_key_head_dim=8, linear_value_head_dim=8, moe_intermediate_size=24, num_experts=8,
                        num_experts_per_tok=2, shared_expert_intermediate_size=40,
                        **{**_COMMON, "num_hidden_layers": 4}),
    # Qwen3-Next: that stack with the linear layers' projections fused per key-head group (in_proj_qkvz, in_proj_ba),
    # 2 value heads per key head, top-k renormalised by norm_topk_prob.
    "qwen3_next": dict(model_type="qwen3_next", head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=8, linear_value_head_dim=8, moe_intermediate_size=24, num_experts=8,
                       num_experts_per_tok=2, shared_expert_intermediate_size=40, norm_topk_prob=True,
                       **{**_COMMON, "num_hidden_layers": 4}),
}


MOE_FAMILIES = tuple(kind for kind, hf in FAMILIES.items() if "num_experts" in hf or "num_local_experts" in hf)


def one_per_model_type() -> list[str]:
    """The first family of each `model_type` in FAMILIES (its variants, e.g. the RoPE scalings, left out): what
    the per-family tests that cost a training step or a sampling run iterate, so a new model type joins them."""
    first: dict[str, str] = {}
    for kind, hf in FAMILIES.items():
        first.setdefault(hf["model_type"], kind)
    return list(first.values())

# A tiny Llama for trainer tests (with the arithmetic task's tokenizer).
TINY = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)


def make_hf_model(kind: str, seed: int = 0):
    """A random transformers causal LM of family `kind` (torch, float32, eager attention, random norms and
    biases so a converter that drops or swaps them fails): `bench/common.py`'s builder, shared with the
    benchmarks."""
    from bench.common import random_hf_model

    return random_hf_model(FAMILIES[kind], seed, eager=True, random_norms_and_biases=True)


PAD = 0  # the pad id of the left-padded batches


def left_padded_batch(vocab_size: int, lengths: list[int], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and attention mask `[B, max(lengths)]`, rows left-padded (pad id 0) to different lengths."""
    rng = np.random.default_rng(seed)
    t = max(lengths)
    tokens = np.zeros((len(lengths), t), np.int32)
    mask = np.zeros((len(lengths), t), np.int32)
    for i, n in enumerate(lengths):
        tokens[i, t - n :] = rng.integers(1, vocab_size, n)
        mask[i, t - n :] = 1
    return tokens, mask


def hf_logits(model, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """transformers' logits for a left-padded batch with positions from the mask (as generate does)."""
    import torch

    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            position_ids=torch.tensor(positions, dtype=torch.long),
        )
    return out.logits.float().numpy()


def hf_generate(model, tokens: np.ndarray, mask: np.ndarray, new_tokens: int, eos_ids=None) -> np.ndarray:
    """transformers' greedy `generate` on a left-padded batch: completions `[B, new_tokens]`, 0-padded."""
    import torch

    model.generation_config.eos_token_id = eos_ids  # None: never stop early
    with torch.no_grad():
        out = model.generate(
            torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            do_sample=False,
            max_new_tokens=new_tokens,
            pad_token_id=PAD,
        )
    completions = out[:, tokens.shape[1] :].numpy()
    return np.pad(completions, ((0, 0), (0, new_tokens - completions.shape[1])), constant_values=PAD)

"""Mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, gpt-oss) against transformers' PyTorch models, float32
on CPU: the experts each token is routed to, gradients of the router, experts and shared expert against torch
autograd, the load-balancing loss, the grouped-matmul path against the dense reference, routing replay, the export
round trip and the rollout engine. Logit parity in float32 and bfloat16 and greedy parity with `generate` run for
these families with every other one (`helpers.FAMILIES`: models/test_decoder.py, models/test_families.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.errors import ConversionError
from jaxrl_llm.models import moe
from jaxrl_llm.models.decoder import forward
from jaxrl_llm.models.hf import load_hf_model
from jaxrl_llm.models.hf_config import config_from_hf
from jaxrl_llm.models.hf_export import hf_state_dict, save_hf_model
from jaxrl_llm.models.sequences import Sequences
from tests.families import MOE_FAMILIES, left_padded_batch, make_hf_model

pytestmark = pytest.mark.heavy(seconds=59)

LENGTHS = [12, 5, 9]


def _torch_forward(model, tokens: np.ndarray, mask: np.ndarray):  # noqa: ANN202 - torch output
    import torch

    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
    return model(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long),
                 position_ids=torch.tensor(positions, dtype=torch.long), output_router_logits=True)


def _top_k_sets(logits: np.ndarray, k: int) -> np.ndarray:
    """Each row's top-k experts as a sorted set (ties are out of the question: the routers are sharpened)."""
    return np.sort(np.argsort(-logits, axis=-1)[..., :k], axis=-1)


@pytest.mark.parametrize("kind", MOE_FAMILIES)
def test_the_same_experts_are_chosen_as_transformers(kind, hf_model_dir):
    """Every real token of every layer goes to the experts transformers' router picks (its recorded router logits),
    the router logits agree, and the model's load-balancing loss equals transformers' `aux_loss`."""
    import torch

    config, params = load_hf_model(hf_model_dir(kind))
    model = make_hf_model(kind)
    tokens, mask = left_padded_batch(config.vocab_size, LENGTHS, seed=2)
    with torch.no_grad():
        out = _torch_forward(model, tokens, mask)
    theirs = np.stack([r.float().numpy() for r in out.router_logits])  # [L, B * T, E]
    _, routing = forward(params, config, jnp.asarray(tokens), jnp.asarray(mask), return_routing=True)
    k = config.num_experts_per_tok
    ours = np.asarray(routing.experts).reshape(config.num_layers, -1, k)
    valid = mask.reshape(-1).astype(bool)
    np.testing.assert_array_equal(np.sort(ours, axis=-1)[:, valid], _top_k_sets(theirs, k)[:, valid])
    logits = np.asarray(routing.logits).reshape(config.num_layers, -1, config.num_experts)
    np.testing.assert_allclose(logits[:, valid], theirs[:, valid], atol=1e-4, rtol=1e-5)
    # The spread the sharpened routers give: the k-th and (k+1)-th router logits are further apart than two logits
    # within the 1e-4 checked above can be, so no near-tie decides a set. (Their probabilities can both be ~0 on the
    # peaked routers of Qwen3.5's (1 + w) norms: the logits are what top-k orders.)
    ordered = np.sort(logits[:, valid], axis=-1)[..., ::-1]
    assert (ordered[..., k - 1] - ordered[..., k]).min() > 2.5e-4
    aux = moe.load_balancing_loss(jnp.asarray(logits), k, jnp.asarray(mask.reshape(-1)))
    np.testing.assert_allclose(float(aux), float(out.aux_loss), rtol=1e-5)
    assert float(out.aux_loss) > 1.0  # E * sum f P >= 1 with equality only for a perfectly balanced router


def _grads_as_hf(model, tokens: np.ndarray, mask: np.ndarray, weights: np.ndarray, tmp_path) -> dict[str, np.ndarray]:
    """torch autograd's gradients of `sum(weights * logits)` over real tokens, in the checkpoint's tensor names (the
    gradients written as a model's weights by save_pretrained, which undoes transformers' fused expert layout)."""
    import copy

    import torch
    from safetensors.numpy import load_file

    model.zero_grad()
    logits = _torch_forward(model, tokens, mask).logits
    (logits * torch.tensor(weights) * torch.tensor(mask)[..., None]).sum().backward()
    grads = copy.deepcopy(model)
    with torch.no_grad():
        for (_, p), (_, g) in zip(model.named_parameters(), grads.named_parameters(), strict=True):
            g.copy_(p.grad)
    grads.save_pretrained(tmp_path)
    return load_file(tmp_path / "model.safetensors")


@pytest.mark.parametrize("kind", MOE_FAMILIES)
def test_gradients_match_torch_autograd(kind, hf_model_dir, tmp_path):
    """d/dW of a weighted sum of the logits, for every weight (router, each expert's gate/up/down, Qwen2-MoE's shared
    expert and its gate, attention), against torch autograd, float32, through the grouped matmuls."""
    config, params = load_hf_model(hf_model_dir(kind))
    tokens, mask = left_padded_batch(config.vocab_size, LENGTHS, seed=3)
    weights = np.random.default_rng(0).normal(size=(*tokens.shape, config.vocab_size)).astype(np.float32)
    theirs = _grads_as_hf(make_hf_model(kind), tokens, mask, weights, tmp_path)

    def loss(p):
        logits = forward(p, config, jnp.asarray(tokens), jnp.asarray(mask))
        return jnp.sum(logits * weights * mask[..., None])

    ours = dict(hf_state_dict(jax.grad(loss)(params), config))
    assert set(ours) == set(theirs)
    moe_names = [n for n in ours if ".experts." in n or ".router." in n
                 or n.endswith(("gate.weight", "shared_expert_gate.weight"))]
    # one tensor per expert and matrix plus the router; gpt-oss: gate_up, down, their biases, the router's weight and
    # bias per layer
    per_layer = 6 if kind == "gpt_oss" else 3 * config.num_experts + 1
    assert len(moe_names) >= config.num_layers * per_layer
    for name in ours:
        scale = max(float(np.abs(theirs[name]).max()), 1e-3)
        np.testing.assert_allclose(ours[name], theirs[name], atol=2e-4 * scale, rtol=2e-3, err_msg=name)
    router = [n for n in moe_names if n.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight",
                                                  "mlp.router.weight"))]
    assert router and all(np.abs(ours[n]).max() > 1e-3 for n in router)  # the router really learns


@pytest.fixture(scope="module")
def random_moe():
    """A random Qwen3-MoE-shaped `(config, params)` with a sharpened router, without transformers."""
    from jaxrl_llm.models.config import ModelConfig
    from jaxrl_llm.models.decoder import init_params

    config = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, qk_norm=True, num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=16, norm_topk_prob=True, model_type="qwen3_moe")
    params = init_params(config, jax.random.key(0))
    params["layers"]["mlp"]["router"]["kernel"] = params["layers"]["mlp"]["router"]["kernel"] * 40.0
    return config, params


def test_grouped_matmuls_equal_the_dense_reference(random_moe):
    """`ragged_dot` over expert-sorted tokens = every expert on every token, masked: logits and gradients, jitted,
    with padding kept out of the dispatch (its rows are 0 and change nothing of the real tokens)."""
    config, params = random_moe
    tokens, mask = left_padded_batch(config.vocab_size, [10, 3, 7], seed=4)

    def loss(p, cfg):
        return jnp.sum(jnp.sin(forward(p, cfg, jnp.asarray(tokens), jnp.asarray(mask))) * mask[..., None])

    dense = config.replace(moe_compute="dense")
    for cfg in (config, dense):
        assert jax.jit(forward, static_argnums=1)(params, cfg, jnp.asarray(tokens), jnp.asarray(mask)).shape == \
            (*tokens.shape, config.vocab_size)
    ragged_grads = jax.jit(jax.grad(loss), static_argnums=1)(params, config)
    dense_grads = jax.jit(jax.grad(loss), static_argnums=1)(params, dense)
    for a, b in zip(jax.tree.leaves(ragged_grads), jax.tree.leaves(dense_grads), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(forward(params, config, jnp.asarray(tokens), jnp.asarray(mask)),
                               forward(params, dense, jnp.asarray(tokens), jnp.asarray(mask)), atol=1e-5)

    # The experts' op alone: random routing, some tokens invalid.
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(23, 32)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.choice(8, 2, replace=False) for _ in range(23)]), jnp.int32)
    weights = jnp.asarray(rng.random((23, 2)), jnp.float32)
    valid = jnp.asarray(rng.random(23) < 0.7)
    w = moe.Experts(*(jnp.asarray(rng.normal(size=s) * 0.2, jnp.float32) for s in ((8, 32, 16),) * 2 + ((8, 16, 32),)))
    ragged = moe.experts_ragged(x, experts, weights, w, valid=valid)
    np.testing.assert_allclose(ragged, moe.experts_dense(x, experts, weights, w, valid=valid), atol=1e-5)
    assert np.all(np.asarray(ragged)[~np.asarray(valid)] == 0.0)
    # By hand for one token: sum_j w_j down_e(silu(x gate_e) * x up_e).
    n = int(np.flatnonzero(np.asarray(valid))[0])
    by_hand = sum(float(weights[n, j]) * (jax.nn.silu(x[n] @ w.gate[e]) * (x[n] @ w.up[e])) @ w.down[e]
                  for j, e in enumerate(np.asarray(experts[n])))
    np.testing.assert_allclose(ragged[n], by_hand, atol=1e-5)


def test_every_expert_form_computes_the_same_function_with_gpt_oss_biases_and_clamp():
    """The samplers' fused form (`moe.fused_experts`: every expert in two matmuls), the grouped matmuls and the dense
    reference agree, plain and with gpt-oss's biases and clamped SwiGLU (by hand for one token: clip, +1, sigmoid
    gain, the biases inside each expert and the down bias weighted by the gate)."""
    rng = np.random.default_rng(1)
    n, d, i, e = 19, 32, 16, 8
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.choice(e, 2, replace=False) for _ in range(n)]), jnp.int32)
    weights = jnp.asarray(rng.random((n, 2)), jnp.float32)
    valid = jnp.asarray(rng.random(n) < 0.8)
    mats = [jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32) for s in ((e, d, i), (e, d, i), (e, i, d))]
    biases = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((e, i), (e, i), (e, d))]
    for w, clamp in ((moe.Experts(*mats), None), (moe.Experts(*mats, *biases), (1.702, 0.5))):
        ragged = moe.experts_ragged(x, experts, weights, w, clamp=clamp, valid=valid)
        dense = moe.experts_dense(x, experts, weights, w, clamp=clamp, valid=valid)
        fused = moe.fused_experts(x, experts, weights, moe.fuse_experts(w, jnp.float32), e, clamp=clamp, valid=valid)
        np.testing.assert_allclose(ragged, dense, atol=1e-5)
        np.testing.assert_allclose(fused, dense, atol=1e-5)
        assert np.all(np.asarray(fused)[~np.asarray(valid)] == 0.0)
    m = int(np.flatnonzero(np.asarray(valid))[0])

    def expert(j: int) -> np.ndarray:
        gate = np.asarray(x[m] @ mats[0][j] + biases[0][j])
        up = np.clip(np.asarray(x[m] @ mats[1][j] + biases[1][j]), -0.5, 0.5)
        g = np.minimum(gate, 0.5)
        return ((up + 1) * g / (1 + np.exp(-1.702 * g))) @ np.asarray(mats[2][j]) + np.asarray(biases[2][j])

    by_hand = sum(float(weights[m, j]) * expert(int(ex)) for j, ex in enumerate(np.asarray(experts[m])))
    np.testing.assert_allclose(fused[m], by_hand, atol=1e-4)


def test_the_samplers_fuse_the_experts_where_it_is_faster(random_moe):
    """`step_weights.fused_step_experts`: on the CPU, few experts per top-k slot (8 of top-2) in either dtype, many
    (128 of top-8) in bfloat16 only; never for the dense reference; the step weights then hold `FusedExperts`."""
    from jaxrl_llm.models.decode import split_layers
    from jaxrl_llm.models.step_weights import fused_step_experts, step_weights

    config, params = random_moe  # 8 experts, top-2
    assert fused_step_experts(config) and fused_step_experts(config.replace(dtype="bfloat16"))
    assert not fused_step_experts(config.replace(moe_compute="dense"))
    wide = config.replace(num_experts=128, num_experts_per_tok=8)
    assert fused_step_experts(wide.replace(dtype="bfloat16")) and not fused_step_experts(wide)
    (w, _) = step_weights(split_layers(params, config), config)
    assert isinstance(w.experts, moe.FusedExperts) and w.experts.gate_up.shape == (32, 8 * 2 * 16)


def test_routing_replay_is_exact_and_the_router_still_learns(random_moe):
    """Replaying the live selection gives the live logits and the live gradient (router included); replaying
    another selection uses it on every token (disagreement 0 against it) and the router still gets a gradient, from
    the live probabilities at the replayed experts; a token without a record keeps its live experts."""
    config, params = random_moe
    tokens, mask = left_padded_batch(config.vocab_size, [10, 6], seed=5)
    t, m = jnp.asarray(tokens), jnp.asarray(mask)
    live_logits, live = forward(params, config, t, m, return_routing=True)

    def loss(p, replay):
        logits, _ = forward(p, config, t, m, replay=replay, return_routing=True)
        return jnp.sum(jnp.sin(logits) * mask[..., None])

    replayed_logits, replayed = forward(params, config, t, m, replay=live.experts, return_routing=True)
    np.testing.assert_array_equal(np.asarray(replayed_logits), np.asarray(live_logits))
    g_live, g_replay = jax.grad(loss)(params, None), jax.grad(loss)(params, live.experts)
    for a, b in zip(jax.tree.leaves(g_live), jax.tree.leaves(g_replay), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # Another selection: each token's two least likely experts.
    other = jnp.argsort(live.logits, axis=-1)[..., :2].astype(jnp.int32)
    logits, routing = forward(params, config, t, m, replay=other, return_routing=True)
    np.testing.assert_array_equal(np.asarray(routing.experts), np.asarray(other))
    disagreement = moe.router_disagreement(routing.experts.reshape(2, -1, 2), other.reshape(2, -1, 2))
    assert float(disagreement.max()) == 0.0
    assert float(moe.router_disagreement(live.experts.reshape(2, -1, 2), other.reshape(2, -1, 2)).min()) == 1.0
    assert float(jnp.abs(logits - live_logits).max()) > 1e-3
    router_grad = jax.grad(loss)(params, other)["layers"]["mlp"]["router"]["kernel"]
    assert float(jnp.abs(router_grad).max()) > 1e-6  # gate weights from the live router: not a zeroed top-k

    # The replayed weights are the live router's probabilities at the replayed experts, renormalized.
    probs = jax.nn.softmax(live.logits[0], axis=-1)
    ids, w = moe.route(live.logits[0], 2, renormalize=True, replay=other[0])
    expected = jnp.take_along_axis(probs, other[0], axis=-1)
    np.testing.assert_allclose(w, expected / expected.sum(-1, keepdims=True), rtol=1e-6)

    # No record on the first row: its tokens route live, the second row's are replayed.
    partial = other.at[:, 0].set(moe.NO_RECORD)
    _, mixed = forward(params, config, t, m, replay=partial, return_routing=True)
    np.testing.assert_array_equal(np.asarray(mixed.experts[:, 0]), np.asarray(live.experts[:, 0]))
    np.testing.assert_array_equal(np.asarray(mixed.experts[:, 1]), np.asarray(other[:, 1]))


def test_load_balancing_loss_by_hand() -> None:
    """Two tokens, four experts, top-1, one layer: f = counts / rows, P = mean probs, loss = E * sum f P; a padded
    token counts nowhere; its gradient reaches the logits through P only."""
    logits = jnp.log(jnp.asarray([[0.7, 0.1, 0.1, 0.1], [0.1, 0.6, 0.2, 0.1], [0.0, 0.0, 0.0, 1.0]]))
    mask = jnp.asarray([1.0, 1.0, 0.0])
    f = np.array([0.5, 0.5, 0.0, 0.0])
    p = np.array([0.4, 0.35, 0.15, 0.1])
    np.testing.assert_allclose(float(moe.load_balancing_loss(logits, 1, mask)), 4 * float(f @ p), rtol=1e-6)
    grad = jax.grad(lambda x: moe.load_balancing_loss(x, 1, mask))(logits)
    assert float(jnp.abs(grad[2]).max()) == 0.0 and float(jnp.abs(grad[:2]).max()) > 0.0
    top, mean = moe.expert_load(jnp.asarray([[[0], [1], [3]]]), 4, mask)
    assert (float(top[0]), float(mean[0])) == (1.0, 0.5)
    np.testing.assert_allclose(moe.routing_confidence(logits[None], 1, mask), [(0.7 + 0.6) / 2], rtol=1e-6)


def test_family_switches_are_read_and_matter(hf_model_dir):
    """Each MoE switch reaches ModelConfig and changes the logits when flipped (parity cannot pass by luck)."""
    tokens, mask = left_padded_batch(97, LENGTHS, seed=7)

    def logits(config, params):
        return np.asarray(forward(params, config, jnp.asarray(tokens), jnp.asarray(mask)))

    qwen3, p3 = load_hf_model(hf_model_dir("qwen3_moe"))
    assert (qwen3.num_experts, qwen3.num_experts_per_tok, qwen3.moe_intermediate_size) == (8, 2, 24)
    assert qwen3.norm_topk_prob and qwen3.qk_norm and not qwen3.qk_norm_projection
    assert float(np.abs(logits(qwen3.replace(norm_topk_prob=False), p3) - logits(qwen3, p3)).max()) > 1e-4
    qwen2, p2 = load_hf_model(hf_model_dir("qwen2_moe"))
    assert qwen2.shared_expert_intermediate_size == 40 and qwen2.qkv_bias and not qwen2.norm_topk_prob
    no_shared = jax.tree.map(lambda x: x, p2)
    no_shared["layers"]["mlp"]["shared_gate"]["kernel"] = jnp.full_like(p2["layers"]["mlp"]["shared_gate"]["kernel"],
                                                                         -1e4)  # sigmoid -> 0
    assert float(np.abs(logits(qwen2, no_shared) - logits(qwen2, p2)).max()) > 1e-4
    mixtral, _ = load_hf_model(hf_model_dir("mixtral"))
    assert mixtral.norm_topk_prob and mixtral.sliding_window == 5 and mixtral.moe_intermediate_size == 64
    olmoe, po = load_hf_model(hf_model_dir("olmoe"))
    assert olmoe.qk_norm_projection and po["layers"]["attn"]["q_norm"]["scale"].shape == (2, 32)
    assert config_from_hf({**_hf_config(hf_model_dir("olmoe")), "norm_topk_prob": True}).norm_topk_prob


def test_gpt_oss_switches_are_read_and_matter(hf_model_dir):
    """gpt-oss's features reach ModelConfig and each changes the logits when removed: the sinks (zeroed weights are
    not "no sink": a sink of -inf is), the clamp of the SwiGLU (its limit 0.3 bites), the router's and experts'
    biases, the alternating windows and YaRN without truncation; so its parity with transformers is no accident."""
    tokens, mask = left_padded_batch(97, LENGTHS, seed=7)

    def logits(config, params):
        return np.asarray(forward(params, config, jnp.asarray(tokens), jnp.asarray(mask)))

    config, params = load_hf_model(hf_model_dir("gpt_oss"))
    assert config.attention_sinks and config.router_bias and config.expert_bias and config.norm_topk_prob
    assert config.swiglu_clamp == (1.702, 0.3) and config.qkv_bias and config.o_bias
    assert config.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    scaling = dict(config.rope_scaling)
    assert scaling["rope_type"] == "yarn" and scaling["truncate"] is False and config.rope_theta == 150000.0
    base = logits(config, params)

    def changed(cfg, p=params) -> float:
        return float(np.abs(logits(cfg, p) - base).max())

    no_sinks = jax.tree.map(lambda x: x, params)
    no_sinks["layers"]["attn"]["sinks"] = jnp.full_like(params["layers"]["attn"]["sinks"], -1e4)
    assert changed(config, no_sinks) > 1e-3
    assert changed(config.replace(swiglu_clamp=(1.702, 100.0))) > 1e-3
    for name in ("router", "experts"):
        zeroed = jax.tree.map(lambda x: x, params)
        for leaf in (zeroed["layers"]["mlp"]["router"],) if name == "router" else \
                zeroed["layers"]["mlp"]["experts"].values():
            leaf["bias"] = jnp.zeros_like(leaf["bias"])
        assert changed(config, zeroed) > 1e-3, name
    assert changed(config.replace(layer_types=None)) > 1e-3  # every layer sliding instead of alternating
    # YaRN's untruncated ramp: the frequencies transformers computes for this config, which truncation would change
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jaxrl_llm.models.layers import rope_parameters

    theirs, factor = ROPE_INIT_FUNCTIONS["yarn"](AutoConfig.from_pretrained(hf_model_dir("gpt_oss")))
    inv_freq, _, _, attention = rope_parameters(config)
    np.testing.assert_allclose(inv_freq, theirs.numpy(), rtol=1e-6)
    assert attention == pytest.approx(factor)
    truncated = rope_parameters(config.replace(rope_scaling=tuple(sorted({**scaling, "truncate": True}.items()))))[0]
    assert np.abs(truncated - theirs.numpy()).max() > 1e-3


def test_gpt_oss_refuses_quantized_checkpoints_and_exports_only_as_itself(hf_model_dir):
    gpt_oss = _hf_config(hf_model_dir("gpt_oss"))
    with pytest.raises(ConversionError, match="gpt_oss quantized with 'mxfp4' is not supported: load a bfloat16"):
        config_from_hf({**gpt_oss, "quantization_config": {"quant_method": "mxfp4"}})
    without_rope = {k: v for k, v in gpt_oss.items() if k not in ("rope_parameters", "rope_scaling")}
    assert dict(config_from_hf(without_rope).rope_scaling)["factor"] == 32.0  # transformers' default YaRN
    config, params = load_hf_model(hf_model_dir("gpt_oss"))
    with pytest.raises(ConversionError, match=r"no attention sinks, .* export it as one of \['gpt_oss'\]"):
        save_hf_model(params, config.replace(model_type="mixtral"), "/nonexistent/never-written")


def _hf_config(model_dir) -> dict:  # noqa: ANN001
    import json

    return json.loads((model_dir / "config.json").read_text())


def test_unsupported_moe_configs_say_why(hf_model_dir):
    base = _hf_config(hf_model_dir("qwen3_moe"))
    with pytest.raises(ConversionError, match="every layer must be an MoE layer"):
        config_from_hf({**base, "decoder_sparse_step": 2})
    with pytest.raises(ConversionError, match="every layer must be an MoE layer"):
        config_from_hf({**base, "mlp_only_layers": [0]})
    with pytest.raises(ConversionError, match="clip_qkv"):
        config_from_hf({**_hf_config(hf_model_dir("olmoe")), "clip_qkv": 8.0})
    with pytest.raises(ConversionError, match="DeepSeek-V3's multi-head latent attention is not supported"):
        config_from_hf({**base, "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]})
    config, params = load_hf_model(hf_model_dir("qwen3_moe"))
    with pytest.raises(ConversionError, match="cannot export a mixture of experts as 'llama'"):
        save_hf_model(params, config.replace(model_type="llama"), "/nonexistent/never-written")


@pytest.mark.parametrize(("kind", "dtype"), [(kind, "float32") for kind in MOE_FAMILIES]
                         + [("qwen2_moe", "bfloat16"), ("mixtral", "bfloat16"), ("gpt_oss", "bfloat16")])
def test_the_engine_decodes_as_the_trainer_scores(kind, dtype, hf_model_dir):
    """Greedy tokens through the rollout engine (paged KV, its CPU kernels where built; bfloat16: packed weights on
    AMX) are the argmax of a fresh forward pass over prompt + completion, and their log-probs that pass's."""
    from jaxrl_llm.engine import engine_sample
    from jaxrl_llm.sampling import SamplingConfig, sample
    from tests.batches import small_engine
    from tests.numerics import fresh_logits, gather_logprobs

    config, params = load_hf_model(hf_model_dir(kind), param_dtype=dtype, dtype=dtype)
    tokens, mask = left_padded_batch(config.vocab_size, [5, 12, 1, 9], seed=8)
    greedy = functools.partial(SamplingConfig, max_new_tokens=12, greedy=True)()
    if config.is_hybrid:  # no engine for linear-attention layers yet: the sampler make_sampler hands them to
        out = sample(params, config, tokens, mask, jax.random.key(0), greedy)
    else:
        out = engine_sample(small_engine(config), params, config, tokens, mask, jax.random.key(0), greedy)
    logits = fresh_logits(params, config, tokens, mask, out, n=1)
    valid = out.mask.astype(bool)
    assert (np.asarray(logits).argmax(-1) == out.tokens)[valid].mean() >= (1.0 if dtype == "float32" else 0.95)
    expected = gather_logprobs(np.asarray(jax.nn.log_softmax(logits)), out.tokens)
    assert np.abs(out.logprobs_untruncated - expected)[valid].max() <= (1e-4 if dtype == "float32" else 5e-2)


# ---------------------------------------------------------------------------------------------- recording, replay


@pytest.mark.parametrize(("sampler", "kind"), [("engine", "qwen2_moe"), ("static", "qwen2_moe"),
                                              ("static", "qwen3_5_moe")])  # Qwen3.5-MoE: a hybrid stack
def test_the_samplers_record_the_experts_the_trainer_would_choose(sampler, kind, hf_model_dir):
    """Every prompt token and every fed completion token has a record (`SampleOutput.routing`, prompts left-padded
    as the batch, 3 extra padding columns included), nothing else has, and each record is the trainer's own top-k
    on a fresh float32 forward over prompt + completion (the same function, so every token agrees)."""
    from jaxrl_llm.engine import engine_sample
    from jaxrl_llm.sampling import SamplingConfig, sample
    from tests.batches import small_engine

    config, params = load_hf_model(hf_model_dir(kind))
    tokens, mask = left_padded_batch(config.vocab_size, [5, 12, 1, 9], seed=8)
    tokens, mask = np.pad(tokens, ((0, 0), (3, 0))), np.pad(mask, ((0, 0), (3, 0)))
    s = SamplingConfig(max_new_tokens=10, temperature=1.0, n=2, eos_ids=tuple(range(3, 13)))
    out = (engine_sample(small_engine(config), params, config, tokens, mask, jax.random.key(0), s)
           if sampler == "engine" else sample(params, config, tokens, mask, jax.random.key(0), s))
    routing = np.asarray(out.routing)
    assert routing.shape == (8, 15 + 10, config.num_layers, 2) and routing.dtype == np.int16
    prompt_mask, lengths = np.repeat(mask, 2, axis=0), np.asarray(out.lengths)
    fed = np.concatenate([prompt_mask, (np.arange(10)[None] < (lengths - 1)[:, None]).astype(np.int32)], axis=1)
    recorded = routing[..., 0, 0] != moe.NO_RECORD
    np.testing.assert_array_equal(recorded, fed.astype(bool))
    assert (lengths < 10).any() and (lengths == 10).any()  # some rows stopped on EOS, some ran to the limit
    full = np.concatenate([np.repeat(tokens, 2, axis=0), np.asarray(out.tokens)], axis=1)
    full_mask = np.concatenate([prompt_mask, np.asarray(out.mask)], axis=1)
    _, live = forward(params, config, jnp.asarray(full), jnp.asarray(full_mask), return_routing=True)
    live = np.moveaxis(np.asarray(live.experts), 0, 2)  # [N, S, L, k]
    np.testing.assert_array_equal(np.sort(routing, -1)[recorded], np.sort(live, -1)[recorded])


def test_records_replay_the_same_through_packed_rows(random_moe):
    """A record replayed through a packed layout gives the padded layout's log-probs, and the packed pass's own
    records (`live_records`) equal the padded pass's: the records travel with their tokens through packing."""
    from jaxrl_llm.models.packing import batch_layout
    from jaxrl_llm.trainers.objectives import completion_logprobs, live_records

    config, params = random_moe
    rng = np.random.default_rng(3)
    pt, pm = left_padded_batch(config.vocab_size, [2, 7, 1, 3], seed=9)
    lengths = [2, 6, 1, 3]
    ct = rng.integers(1, config.vocab_size, (4, 7)).astype(np.int32)
    cm = (np.arange(7)[None] < np.asarray(lengths)[:, None]).astype(np.int32)
    valid = np.concatenate([pm, cm], axis=1)[:, :-1] > 0
    layout, _, _ = batch_layout(valid, pt.shape[1])
    assert layout.source.shape[0] < 4  # some sequences share a row
    args = (Sequences(*map(jnp.asarray, (pt, pm, ct, cm))),)
    _, _, padded = completion_logprobs(params, config, *args)
    records = live_records(padded, config, (4, pt.shape[1] + 7))
    _, _, packed = completion_logprobs(params, config, *args, layout=layout)
    np.testing.assert_array_equal(np.asarray(live_records(packed, config, (4, pt.shape[1] + 7), layout)),
                                  np.asarray(records))
    # Replay a selection unlike the router's (its least likely experts) both ways: the same log-probs.
    other = jnp.where(records != moe.NO_RECORD, (records + 3) % config.num_experts, moe.NO_RECORD)
    logp_padded, _, _ = completion_logprobs(params, config, *args, replay=other)
    logp_packed, _, _ = completion_logprobs(params, config, *args, layout=layout, replay=other)
    logp_live, _, _ = completion_logprobs(params, config, *args)
    np.testing.assert_allclose(np.asarray(logp_packed)[cm > 0], np.asarray(logp_padded)[cm > 0], atol=1e-5)
    assert float(np.abs(np.asarray(logp_padded) - np.asarray(logp_live))[cm > 0].max()) > 1e-3


def test_records_survive_an_in_flight_checkpoint():
    """A rollout in flight (sampling beside training) is checkpointed with its routing record and restored equal."""
    from jaxrl_llm.sampling import SampleOutput
    from jaxrl_llm.trainers.overlap import decode_sampled, encode_sampled
    from jaxrl_llm.trainers.rollouts import Rollout

    rng = np.random.default_rng(0)
    routing = rng.integers(-1, 8, (4, 9, 2, 2)).astype(np.int16)
    out = SampleOutput(np.ones((4, 3), np.int32), np.ones((4, 3), np.int32), np.zeros((4, 3), np.float32),
                       np.zeros((4, 3), np.float32), np.full(4, 3, np.int32), np.zeros(4, bool), routing)
    ro = Rollout(np.ones((4, 6), np.int32), np.ones((4, 6), np.int32), out, np.zeros(4, np.float32), {}, ["a"] * 4,
                 np.arange(1))
    (back,) = decode_sampled(__import__("json").loads(__import__("json").dumps(encode_sampled([ro]))))
    np.testing.assert_array_equal(back.out.routing, routing)
    assert back.out.routing.dtype == np.int16


@pytest.fixture(scope="module")
def moe_task(tiny_task, tmp_path_factory):
    """`tiny_task` with a random tiny Qwen3-MoE (arithmetic tokenizer, 16 experts, top 2) as its model."""
    import shutil

    from jaxrl_llm.models.decoder import init_params

    root = tmp_path_factory.mktemp("moe_task")
    for name in ("train.jsonl", "test.jsonl"):
        shutil.copy(tiny_task / name, root / name)
    tokenizer_dir = tiny_task / "model"
    vocab = _hf_config(tokenizer_dir)["vocab_size"]
    config = config_from_hf(dict(model_type="qwen3_moe", vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                 moe_intermediate_size=8, num_experts=16, num_experts_per_tok=2, norm_topk_prob=True,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                 max_position_embeddings=64, tie_word_embeddings=True, eos_token_id=2,
                                 bos_token_id=1))
    # The router as initialised (std 0.02): near-uniform, and with 16 experts the 2nd and 3rd are often close, so
    # bfloat16 sampling flips a few choices in every rollout (about 4 in 1,000 tokens; with 4 experts it was 1 in
    # 600, and a run could see none).
    save_hf_model(init_params(config, jax.random.key(1)), config, root / "model", tokenizer_dir=tokenizer_dir)
    return root


def _moe_run(task, out, *overrides):  # noqa: ANN001, ANN202
    from jaxrl_llm.trainers import make_trainer
    from tests.runs import tiny_run

    config = tiny_run("grpo_arithmetic", out, "model.dtype=float32", "sampling.dtype=bfloat16", "data.eval=",
                      "rewards=[{name: 'tests.runs:completion_length'}]", *overrides, task=task)
    trainer = make_trainer(config)
    trainer.run()
    from tests.runs import read_rows

    return trainer, read_rows(out, "reward/mean")


def test_grpo_on_moe_with_each_replay_mode(moe_task, tmp_path):
    """One GRPO step per `rl.routing_replay` mode from the same rollout (same seed; bf16 sampling, float32 update):
    every mode logs the router's metrics and the mismatch; replaying the sampler's routing changes the trainer's
    log-probs exactly where the two routings disagreed, `old` replays the old pass's own choice (no disagreement in
    the update's forward). The router's load-balancing term, when asked for, is in the loss. (`model.freeze_router`:
    the gpt-oss run below.)"""
    rows = {}
    for mode in ("none", "old", "rollout"):
        _, steps = _moe_run(moe_task, tmp_path / mode, f"rl.routing_replay={mode}", "steps=1",
                            "rl.prompts_per_step=8", "rl.group_size=8", "sampling.max_new_tokens=12")
        rows[mode] = steps[0]
    # `model.router_aux_loss_coef` adds coef x the load-balancing loss to the loss, from the same rollout.
    _, aux = _moe_run(moe_task, tmp_path / "aux", "steps=1", "rl.prompts_per_step=8", "rl.group_size=8",
                      "sampling.max_new_tokens=12", "model.router_aux_loss_coef=0.5")
    np.testing.assert_allclose(aux[0]["loss"], rows["none"]["loss"] + 0.5 * rows["none"]["moe/aux_loss"], rtol=1e-4)
    for mode, row in rows.items():
        for name in ("moe/aux_loss", "moe/load_max_mean", "moe/confidence", "moe/layer_00/confidence",
                     "mismatch/logprob_abs_mean", "mismatch/live_router_vs_rollout",
                     "mismatch/live_router_vs_rollout/layer_01", "moe/router_disagreement"):
            assert np.isfinite(row[name]), (mode, name)
    # bf16 sampling flips a few of the near-uniform router's choices (about 2 in 1,000 tokens here); replaying the
    # sampler's records then changes the trainer's log-probs on those tokens, and only there.
    assert rows["none"]["mismatch/live_router_vs_rollout"] == rows["rollout"]["mismatch/live_router_vs_rollout"]
    flipped = rows["none"]["mismatch/live_router_vs_rollout"] > 0
    moved = rows["rollout"]["mismatch/logprob_abs_mean"] != rows["none"]["mismatch/logprob_abs_mean"]
    assert moved == flipped
    # What the update ran: the sampler's routing under replay (no disagreement left), the live router's without.
    assert rows["rollout"]["mismatch/update_routing_vs_rollout"] == 0.0
    assert rows["none"]["mismatch/update_routing_vs_rollout"] == rows["none"]["mismatch/live_router_vs_rollout"]
    assert rows["old"]["moe/router_disagreement"] == 0.0  # one update: the old pass's choice is the live one


def test_lora_adapts_every_expert_through_the_grouped_matmul(random_moe):
    """Per-expert adapters `A [L, E, D, r]`, `B [L, E, r, I]` (the default targets match the experts' projections, not
    the router): merged, expert e's matrix is `W_e + scale A_e B_e`; the unmerged (dropout) path merges the experts'
    and gives the same logits without dropout; PEFT export of expert adapters is refused with the reason."""
    from jaxrl_llm.models.lora import LoraSpec, init_adapters, insert_adapters, merge_adapters, save_peft_adapters

    config, params = random_moe
    spec = LoraSpec(rank=2, alpha=4.0, targets="(q|k|v|o|gate|up|down)_proj")
    adapters = init_adapters(params, spec, jax.random.key(3))
    experts = adapters["layers"]["mlp"]["experts"]
    assert experts["gate"]["lora_a"].shape == (2, 8, 32, 2) and experts["down"]["lora_b"].shape == (2, 8, 2, 32)
    assert "router" not in adapters["layers"]["mlp"]
    adapters = jax.tree.map(lambda x: x + 0.05, adapters)  # B = 0 at init: give it a value
    merged = merge_adapters(params, adapters, spec.scale)
    a, b = (np.asarray(experts["up"][n]) + 0.05 for n in ("lora_a", "lora_b"))
    np.testing.assert_allclose(np.asarray(merged["layers"]["mlp"]["experts"]["up"]["kernel"][1, 5]),
                               np.asarray(params["layers"]["mlp"]["experts"]["up"]["kernel"][1, 5])
                               + spec.scale * a[1, 5] @ b[1, 5], rtol=1e-5, atol=1e-6)
    tokens, mask = left_padded_batch(config.vocab_size, [6, 3], seed=10)
    unmerged = insert_adapters(params, adapters, spec.scale)
    lora_config = config.replace(lora_scale=spec.scale)
    np.testing.assert_allclose(forward(unmerged, lora_config, jnp.asarray(tokens), jnp.asarray(mask)),
                               forward(merged, config, jnp.asarray(tokens), jnp.asarray(mask)), atol=1e-5)
    with pytest.raises(ConversionError, match="PEFT adapters on an MoE model's experts"):
        save_peft_adapters(adapters, config, spec, "/nonexistent/never-written", "base")


@pytest.mark.parametrize("algo", ["sft", "dpo", "distill", "ppo"])
def test_every_algorithm_runs_on_a_moe_model_with_its_router_terms(algo, moe_task, tmp_path):
    """SFT, DPO, on-policy distillation (GKD's JSD) and PPO (replaying the sampler's routing) on an MoE student: each
    step's loss includes `coef x moe/aux_loss` and the router's metrics are logged."""
    from jaxrl_llm.trainers import make_trainer
    from tests.runs import read_rows, tiny_run

    common = ["model.router_aux_loss_coef=0.5", "steps=1", "checkpoint_every=0", "sft.batch_size=8", "data.eval="]
    if algo == "sft":  # SFT of model.path (the GRPO preset: no model.init)
        config = tiny_run("grpo_arithmetic", tmp_path / algo, "algo=sft", *common, task=moe_task)
    elif algo == "dpo":
        rows = [__import__("json").loads(line) for line in (moe_task / "train.jsonl").read_text().splitlines()][:32]
        prefs = tmp_path / "prefs.jsonl"
        prefs.write_text("".join(__import__("json").dumps({"prompt": r["prompt"], "chosen": r["answer"],
                                                          "rejected": str(int(r["answer"]) + 1)}) + "\n" for r in rows))
        config = tiny_run("dpo_arithmetic", tmp_path / algo, *common, f"data.train={prefs}", "dpo.eval_prompts=",
                          task=moe_task)
    elif algo == "ppo":
        config = tiny_run("ppo_arithmetic", tmp_path / algo, *common, "rl.routing_replay=rollout",
                          "rl.prompts_per_step=4", "rl.group_size=2", "rl.minibatch_size=8", task=moe_task)
    else:  # the student its own teacher: GKD's JSD from the same MoE
        config = tiny_run("distill_arithmetic", tmp_path / algo, *common, "distill.loss=jsd",
                          f"distill.teacher={moe_task / 'model'}", "rl.prompts_per_step=4", "rl.group_size=4",
                          task=moe_task)
    make_trainer(config).run()
    (row,) = read_rows(tmp_path / algo, "moe/aux_loss")[:1]
    if algo == "ppo":
        assert 0 <= row["mismatch/live_router_vs_rollout"] <= 1 and np.isfinite(row["mismatch/logprob_abs_mean"])
    assert row["moe/aux_loss"] > 1.0 and 0 < row["moe/confidence"] <= 1 and row["moe/load_max_mean"] >= 1
    own = {"sft": "sft_loss", "distill": "distill/jsd"}.get(algo)
    if own is not None:  # one micro-batch: the loss is the algorithm's own plus 0.5 x the load-balancing loss
        np.testing.assert_allclose(row["loss"], row[own] + 0.5 * row["moe/aux_loss"], rtol=1e-4)


def test_grpo_trains_a_gpt_oss_model_with_rollout_replay_and_a_frozen_router(moe_task, tmp_path):
    """gpt-oss through the whole loop: the engine samples it (its sinks on the XLA path) and records its routing, a
    GRPO step replays that routing with the router frozen: the
    router's weights and biases stay, the experts' weights and biases move, and the result exports as gpt_oss and
    loads back."""
    import shutil

    from jaxrl_llm.models.decoder import init_params
    from jaxrl_llm.models.hf import load_hf_model as load
    from tests.runs import read_rows

    task = tmp_path / "task"
    shutil.copytree(moe_task, task, ignore=shutil.ignore_patterns("model"))
    tokenizer_dir = moe_task / "model"
    config = config_from_hf(dict(model_type="gpt_oss", vocab_size=_hf_config(tokenizer_dir)["vocab_size"],
                                 hidden_size=32, intermediate_size=8, num_local_experts=8, num_experts_per_tok=2,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                 sliding_window=8, max_position_embeddings=64, eos_token_id=2, bos_token_id=1))
    save_hf_model(init_params(config, jax.random.key(2)), config, task / "model", tokenizer_dir=tokenizer_dir)
    trainer, rows = _moe_run(task, tmp_path / "run", "rl.routing_replay=rollout", "model.freeze_router=true",
                             "steps=2", "rl.prompts_per_step=4", "rl.group_size=4", "sampling.max_new_tokens=8")
    row = read_rows(tmp_path / "run", "moe/router_disagreement")[-1]
    # the live router vs the engine's bf16 records (replayed, so only measured); their log-prob mismatch
    assert 0 <= row["moe/router_disagreement"] < 0.5 and np.isfinite(row["mismatch/logprob_abs_mean"])
    before = load(task / "model")[1]["layers"]
    after = trainer.state["params"]["layers"]
    for path in (("mlp", "router", "kernel"), ("mlp", "router", "bias")):
        np.testing.assert_array_equal(np.asarray(_at(after, path)), np.asarray(_at(before, path)), err_msg=str(path))
    for path in (("mlp", "experts", "gate", "kernel"), ("mlp", "experts", "down", "bias"), ("attn", "sinks")):
        assert float(jnp.abs(_at(after, path) - _at(before, path)).max()) > 0, path
    save_hf_model(trainer.state["params"], trainer.algorithm.policy.model_config, tmp_path / "export")
    assert load(tmp_path / "export")[0].model_type == "gpt_oss"


def _at(tree, path):  # noqa: ANN001, ANN202
    for key in path:
        tree = tree[key]
    return tree


def test_the_moe_preset_trains_the_committed_moe_model(tmp_path):
    """`configs/grpo_arithmetic_moe.yaml` from `models/arith-moe-base` (what the MoE job runs): two steps with bf16
    sampling and a float32 update, replaying the sampler's routing; the router's mismatch is logged."""
    from jaxrl_llm.config import load_run_config
    from jaxrl_llm.trainers import make_trainer
    from tests.runs import CONFIGS, QUIET, read_rows

    config = load_run_config(CONFIGS / "grpo_arithmetic_moe.yaml", [f"out_dir={tmp_path / 'run'}", "steps=2",
                                                                    "data.eval=", "rl.prompts_per_step=4", *QUIET])
    assert config.rl.routing_replay == "rollout" and config.sampling.dtype == "bfloat16"
    make_trainer(config).run()
    rows = read_rows(tmp_path / "run", "reward/mean")
    assert len(rows) == 2 and all(0 <= r["mismatch/live_router_vs_rollout"] < 0.2 for r in rows)
    assert all(r["moe/load_max_mean"] < 8 / 2 for r in rows)  # no collapsed layer: max / mean < E / k


@pytest.fixture(scope="module")
def chatty_moe_task(moe_task, tmp_path_factory):
    """`moe_task` whose generation config counts a third of the vocabulary as end-of-turn tokens: the random model
    ends most turns by itself within a few tokens, so episodes reach their later turns (a turn cut at its token
    limit ends the episode)."""
    import shutil

    root = tmp_path_factory.mktemp("chatty_moe_task")
    shutil.copytree(moe_task, root, dirs_exist_ok=True)
    vocab = _hf_config(root / "model")["vocab_size"]
    (root / "model" / "generation_config.json").write_text(
        __import__("json").dumps({"eos_token_id": list(range(2, 2 + vocab // 3))}))
    return root


@pytest.mark.parametrize("engine", ["paged", "static"])
def test_multi_turn_episodes_record_every_token_the_sampler_routed(chatty_moe_task, tmp_path, engine):
    """Multi-turn episodes (an environment that answers twice) on an MoE model: the rollout's records cover each
    episode's prompt, the model's turns and the environment's replies (those the next turn's prefill routed), every
    token but the last (which is never fed), through the rollout engine (conversations kept) and through the static
    sampler (each turn re-prefilled); nothing is recorded on padding."""
    from jaxrl_llm.models.moe import NO_RECORD
    from jaxrl_llm.trainers import make_trainer
    from tests.runs import tiny_run

    config = tiny_run("grpo_arithmetic", tmp_path / "run", "data.eval=",
                      "env.name=tests.trainers.test_multi_turn:chatty",
                      "env.max_tokens=64", "rl.routing_replay=rollout", f"sampling.engine={engine}",
                      "rl.prompts_per_step=2", "rl.group_size=2", "sampling.max_new_tokens=6", task=chatty_moe_task)
    algo = make_trainer(config).algorithm
    ro = algo.collector.rollout(algo.policy.inference_weights(algo.init()["params"]), np.arange(2),
                                jax.random.key(0))
    routing, width = np.asarray(ro.out.routing), ro.prompt_tokens.shape[1]
    assert routing.shape[:2] == (4, width + ro.out.tokens.shape[1]) and routing.shape[2:] == (2, 2)
    assert max(ro.episode_stats["turns"]) == 3  # the environment's replies are in the episodes
    for r in range(4):
        prompt, tokens = int(ro.prompt_mask[r].sum()), int(ro.out.mask[r].sum())
        recorded = routing[r, :, 0, 0] != NO_RECORD
        assert recorded[width - prompt:width + tokens - 1].all(), r
        assert not recorded[:width - prompt].any() and not recorded[width + tokens:].any(), r
        chosen = routing[r, width - prompt:width + tokens - 1]
        assert ((chosen >= 0) & (chosen < 16)).all() and (chosen[..., 0] != chosen[..., 1]).all()
    # Replayed in the update's forward, every recorded token of every turn is routed to its recorded experts.
    from jaxrl_llm.trainers.objectives import completion_logprobs

    params = algo.policy.model_weights(algo.init()["params"])
    _, _, routed = completion_logprobs(params, algo.policy.model_config, Sequences(ro.prompt_tokens, ro.prompt_mask,
                                              ro.out.tokens, ro.out.mask), replay=jnp.asarray(routing))
    used = np.moveaxis(np.asarray(routed.routing.experts), 0, 2)  # [N, P + T - 1, L, k]
    recorded = routing[:, :-1, 0, 0] != NO_RECORD
    np.testing.assert_array_equal(used[recorded], routing[:, :-1][recorded])


def test_multi_turn_rollout_replay_runs_and_measures_the_mismatch(chatty_moe_task, tmp_path):
    """One GRPO step of multi-turn episodes sampled in bfloat16 (float32 update), `rl.routing_replay` none and
    rollout from the same rollout: both log the sampler-trainer router disagreement (the same, measured before the
    update) and the log-prob mismatch; replaying the records changes the trainer's log-probs where the routing
    differed (the mean mismatch moves) and nowhere else."""
    rows = {}
    for mode in ("none", "rollout"):
        _, steps = _moe_run(chatty_moe_task, tmp_path / mode, f"rl.routing_replay={mode}", "steps=1",
                            "env.name=tests.trainers.test_multi_turn:chatty", "env.max_tokens=64",
                            "rl.prompts_per_step=4",
                            "rl.group_size=4", "sampling.max_new_tokens=8")
        rows[mode] = steps[0]
    assert rows["none"]["turns/mean"] > 1
    assert rows["none"]["mismatch/live_router_vs_rollout"] == rows["rollout"]["mismatch/live_router_vs_rollout"]
    flipped = rows["none"]["mismatch/live_router_vs_rollout"] > 0  # about 3 in 1,000 tokens here
    moved = rows["rollout"]["mismatch/logprob_abs_mean"] != rows["none"]["mismatch/logprob_abs_mean"]
    assert moved == flipped

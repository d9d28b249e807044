"""Advantage estimators: GRPO / Dr.GRPO group normalisation, RLOO, REINFORCE++, GAE, masked whitening.

Batches are group-major, ``[num_prompts * group_size, ...]``: the ``G = group_size`` completions of one
prompt are contiguous, so ``rewards.reshape(P, G)`` recovers the groups. ``group_size`` is static (it
decides a reshape). All outputs are float32. Formulas and references: ``docs/algorithms.md``.
"""

from collections.abc import Callable
from typing import Any, Literal

import jax.numpy as jnp
from jax import Array, lax

from jaxrl_llm.rl.reductions import masked_mean, masked_reference, masked_var

AdvantageScale = Literal["group", "batch", "none"]


def _grouped(rewards: Array, group_size: int) -> Array:
    """``[..., P * G] -> [..., P, G]`` after checking the static sizes divide."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    n = rewards.shape[-1]
    if n % group_size:
        raise ValueError(f"batch size {n} is not a multiple of group_size {group_size}")
    return jnp.asarray(rewards).astype(jnp.float32).reshape(*rewards.shape[:-1], n // group_size, group_size)


def group_centered(grouped: Array) -> Array:
    """``r_i - mean_j r_j`` within each group, exactly 0 for a group whose rewards are all equal.

    The mean is taken of the rewards shifted by the group's first member, ``d_i = r_i - r_1``, and
    ``r_i - mean r = d_i - mean d``: a tied group has ``d = 0`` exactly, so no rounding of its mean (which
    in float32 differs from the common value by a rounding step for most values and group sizes, and
    depends on XLA's reduction order under jit) survives. Near-tied groups gain precision the same way.

    Shapes: ``grouped [..., P, G]`` float32 -> ``[..., P, G]`` float32.
    """
    shifted = grouped - grouped[..., :1]
    return shifted - jnp.mean(shifted, axis=-1, keepdims=True)


def group_normalized_advantages(
    rewards: Array,
    *,
    group_size: int,
    scale: AdvantageScale = "group",
    epsilon: float = 1e-6,
    ddof: int = 1,
) -> Array:
    """Outcome advantages from a group baseline (GRPO; Dr.GRPO with ``scale="none"``).

    For completion ``i`` of a group with rewards ``r_1..r_G``::

        A_i = (r_i - mean_j r_j) / (std + epsilon)

    * ``scale="group"``: ``std`` is the standard deviation of the group's rewards (GRPO, Shao et al. 2024,
      DeepSeekMath, eq. for outcome supervision).
    * ``scale="batch"``: ``std`` of all rewards in the batch (group mean, batch std; Liu et al. 2025,
      "Tricks or Traps? A Deep Dive into RL for LLM Reasoning"); avoids blowing up near-unanimous groups.
    * ``scale="none"``: no division at all (Dr.GRPO, Liu et al. 2025, "Understanding R1-Zero-Like
      Training": the std division over-weights too-easy / too-hard questions).

    ``std`` uses ``ddof`` (default 1: the unbiased estimator, matching ``torch.std`` in TRL and verl).
    ``epsilon`` is *added* to the std, and the statistics are taken of rewards shifted by one member of the group
    (``group_centered``), so a group with identical rewards gets ``A = 0`` exactly, jitted or not, in every scale.

    Shapes: ``rewards [B]`` with ``B = P * group_size`` (group-major) -> ``[B]`` float32.
    """
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"unknown scale {scale!r}; expected 'group', 'batch' or 'none'")
    grouped = _grouped(rewards, group_size)
    if scale == "group" and ddof >= group_size:
        raise ValueError(f"ddof={ddof} needs group_size > ddof, got group_size={group_size}")
    centered = group_centered(grouped)
    if scale == "group":
        centered = centered / (jnp.std(centered, axis=-1, ddof=ddof, keepdims=True) + epsilon)
    elif scale == "batch":
        flat = grouped.reshape(*grouped.shape[:-2], -1)
        std = jnp.std(flat - flat[..., :1], axis=-1, ddof=ddof, keepdims=True)[..., None]
        centered = centered / (std + epsilon)
    return centered.reshape(rewards.shape)


def rloo_advantages(rewards: Array, *, group_size: int) -> Array:
    """REINFORCE Leave-One-Out advantages (Ahmadian et al. 2024; Kool et al. 2019).

    Each sample's baseline is the mean reward of the *other* ``G - 1`` samples of its group::

        A_i = r_i - (1 / (G - 1)) sum_{j != i} r_j  =  G / (G - 1) * (r_i - mean_j r_j)

    The baseline does not depend on ``r_i``, so the estimator stays unbiased. Computed as the right-hand form
    from rewards shifted by one member of the group, so a tied group gets exactly 0.

    Shapes: ``rewards [B]``, ``B = P * group_size`` group-major, ``group_size >= 2`` -> ``[B]`` float32.
    """
    if group_size < 2:
        raise ValueError(f"RLOO needs group_size >= 2, got {group_size}")
    # G / (G - 1) * (r_i - mean r) with the group's statistics shifted by its first member (`group_centered`):
    # a tied group's advantage is exactly 0, where `sum - r_i` rounds differently for each i.
    return (group_size / (group_size - 1) * group_centered(_grouped(rewards, group_size))).reshape(rewards.shape)


def masked_whiten(
    x: Array,
    mask: Array,
    *,
    shift_mean: bool = True,
    epsilon: float = 1e-8,
    ddof: int = 1,
    axis: int | tuple[int, ...] | None = None,
) -> Array:
    """Normalise ``x`` with statistics over its valid entries only.

    ``(x - mean) / sqrt(var + epsilon)`` with masked mean and masked variance (``ddof=1``: unbiased).
    With ``shift_mean=False`` the mean is added back (rescale only). Padded entries are set to 0.

    Shapes: ``x``, ``mask`` ``[B, T]`` (statistics over the whole batch by default, ``axis=None``).
    """
    # Statistics of x shifted by one of its valid values: all-equal valid values whiten to exactly 0 (their float32
    # mean is off by a rounding step, which rsqrt(var + 1e-8) would blow up to ~1e-3), and near-equal ones keep
    # their digits.
    reference = masked_reference(x, mask, axis)
    shifted = jnp.asarray(x).astype(jnp.float32) - reference
    mean = masked_mean(shifted, mask, axis, keepdims=True)
    var = masked_var(shifted, mask, axis, ddof=ddof, keepdims=True)
    whitened = (shifted - mean) * lax.rsqrt(var + epsilon)
    if not shift_mean:
        whitened = whitened + (reference + mean)
    return jnp.where(jnp.asarray(mask) > 0, whitened, 0.0)


def _reverse_time_scan(step: Callable[[Any, Any], tuple[Any, Array]], init: Any, *xs: Array) -> Array:
    """Run ``step`` from the last time step to the first over ``[B, T]`` inputs; outputs ``[B, T]``."""
    _, ys = lax.scan(step, init, tuple(jnp.moveaxis(x, -1, 0) for x in xs), reverse=True)
    return jnp.moveaxis(ys, 0, -1)


def discounted_returns(token_rewards: Array, mask: Array, *, gamma: float | Array = 1.0) -> Array:
    """Return-to-go over completion tokens: ``G_t = r_t + gamma * G_{t'}`` with ``t'`` the next valid token.

    Computed by a reverse ``lax.scan``. Masked positions (right padding, or tokens the policy did not
    produce in multi-turn data) neither add reward nor consume a discount step; they get ``G = 0``.

    Shapes: ``token_rewards [B, T]``, ``mask [B, T]`` -> ``[B, T]`` float32.
    """
    r = jnp.asarray(token_rewards).astype(jnp.float32)
    valid = jnp.asarray(mask) > 0
    gamma = jnp.asarray(gamma, jnp.float32)

    def step(running: Array, xs: tuple[Array, Array]) -> tuple[Array, Array]:
        r_t, v_t = xs
        running = jnp.where(v_t, r_t + gamma * running, running)
        return running, jnp.where(v_t, running, 0.0)

    return _reverse_time_scan(step, jnp.zeros(r.shape[:-1], jnp.float32), r, valid)


def reinforce_plus_plus_advantages(
    token_rewards: Array,
    mask: Array,
    *,
    gamma: float | Array = 1.0,
    epsilon: float = 1e-8,
) -> Array:
    """REINFORCE++ advantages (Hu 2025): discounted returns of the KL-shaped token rewards, batch-whitened.

    ``token_rewards`` already contain the KL penalty: ``r_t = -beta * KL_t + [t = last] * score``
    (``losses.kl_shaped_token_rewards``). Then::

        G_t = sum_{k >= t} gamma^{k - t} r_k,    A_t = (G_t - mean(G)) / sqrt(var(G) + epsilon)

    with mean and (unbiased) variance over every valid token of the batch; no critic, no group baseline.

    Shapes: ``token_rewards [B, T]``, ``mask [B, T]`` -> ``[B, T]`` float32 (0 at padding).
    """
    returns = discounted_returns(token_rewards, mask, gamma=gamma)
    return masked_whiten(returns, mask, epsilon=epsilon)


def reinforce_plus_plus_baseline_advantages(
    rewards: Array,
    mask: Array,
    *,
    group_size: int,
    epsilon: float = 1e-8,
) -> Array:
    """REINFORCE++-baseline (Hu 2025): subtract the group mean, broadcast over tokens, whiten the batch.

    ::

        a_i = r_i - mean_{j in group(i)} r_j,    A_it = (a_i - mean(a)) / sqrt(var(a) + epsilon)

    where mean and (unbiased) variance run over every valid token of the batch, i.e. each sequence is
    weighted by its length (as in OpenRLHF / verl). The KL term belongs in the loss for this estimator. A tied
    group's ``a_i`` is exactly 0 (``group_centered``), so all its tokens get the same ``A = -mean(a) / std``.

    Shapes: ``rewards [B]`` (sequence scores, group-major), ``mask [B, T]`` -> ``[B, T]`` float32.
    """
    centered = group_centered(_grouped(rewards, group_size)).reshape(rewards.shape)
    per_token = jnp.broadcast_to(centered[..., None], jnp.shape(mask))
    return masked_whiten(per_token, mask, epsilon=epsilon)


def gae_advantages(
    token_rewards: Array,
    values: Array,
    mask: Array,
    *,
    gamma: float | Array = 1.0,
    lam: float | Array = 0.95,
) -> tuple[Array, Array]:
    """Generalised Advantage Estimation (Schulman et al. 2015) as a reverse ``lax.scan`` over tokens.

    Over valid tokens ``t`` with ``t'`` the next valid token (terminal value 0 after the last one)::

        delta_t = r_t + gamma * V_{t'} - V_t
        A_t     = delta_t + gamma * lam * A_{t'}
        R_t     = A_t + V_t            (the critic's regression target)

    Masked positions are skipped: they neither bootstrap a value nor consume a discount step, so holes
    in the mask (multi-turn observation tokens) and right padding are both handled. With
    ``gamma = lam = 1`` this is ``A_t = sum_{k >= t} r_k - V_t``. Whitening is left to the caller
    (``masked_whiten``), as PPO implementations differ there.

    Shapes: ``token_rewards``, ``values``, ``mask`` ``[B, T]`` -> ``(advantages, returns)`` both
    ``[B, T]`` float32, 0 at padding.
    """
    r = jnp.asarray(token_rewards).astype(jnp.float32)
    v = jnp.asarray(values).astype(jnp.float32)
    valid = jnp.asarray(mask) > 0
    gamma = jnp.asarray(gamma, jnp.float32)
    lam = jnp.asarray(lam, jnp.float32)

    def step(carry: tuple[Array, Array], xs: tuple[Array, Array, Array]) -> tuple[tuple[Array, Array], Array]:
        next_value, next_adv = carry
        r_t, v_t, m_t = xs
        adv = r_t + gamma * next_value - v_t + gamma * lam * next_adv
        carry = (jnp.where(m_t, v_t, next_value), jnp.where(m_t, adv, next_adv))
        return carry, jnp.where(m_t, adv, 0.0)

    zeros = jnp.zeros(r.shape[:-1], jnp.float32)
    advantages = _reverse_time_scan(step, (zeros, zeros), r, v, valid)
    returns = jnp.where(valid, advantages + v, 0.0)
    return advantages, returns


def turn_level_advantages(advantages: Array, credit: Array, rewards: Array, *, group_size: int,
                          scale: AdvantageScale = "group", epsilon: float = 1e-6, ddof: int = 1) -> Array:
    """Per-turn credit in multi-turn episodes whose environment rewards turns (rewards-to-go with a group baseline).

    With ``G_{i,k}`` the return of episode ``i`` from its turn ``k`` on (the rewards of turns ``k, k+1, ...`` and
    the final score) and ``G_{i,1} = r_i`` its whole return, the tokens of turn ``k`` get::

        A_{i,t} = (G_{i,k} - mean_j r_j) / (std + epsilon) = A_i + (G_{i,k} - G_{i,1}) / (std + epsilon)

    the group-normalized advantage of the return still to come: a turn is not credited with rewards earned before
    it. ``credit [N, T]`` holds ``G_{i,k(t)} - G_{i,1}`` (minus the rewards of the turns before ``t``'s; 0 on the
    first turn and on the environment's tokens), ``advantages [N, T]`` the outcome advantages of ``r [N]``
    (``group_normalized_advantages`` broadcast), ``std`` as there (``scale="none"``, or a group whose returns are all
    equal: no division). With every turn reward 0, ``credit`` is 0 and the advantages are unchanged. Returns
    ``[N, T]`` float32.
    """
    r = rewards.astype(jnp.float32)
    if scale == "none":
        return advantages + credit
    # Spreads of the rewards shifted by one of their members: a tied group's is exactly 0 (see `group_centered`).
    if scale == "batch":
        std = jnp.broadcast_to(jnp.std(r - r[:1], ddof=ddof), r.shape)
    else:
        grouped = r.reshape(-1, group_size)
        std = jnp.repeat(jnp.std(grouped - grouped[:, :1], axis=1, ddof=ddof), group_size)
    # A group whose whole returns are all equal has outcome advantages 0; its turns' credit is not divided by 0.
    return advantages + credit / jnp.where(std > 0, std + epsilon, 1.0)[:, None]

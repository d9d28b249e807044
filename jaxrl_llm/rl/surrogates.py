"""Policy-gradient surrogates and their registry: PPO's clipped ratio, GSPO's sequence ratio, CISPO's clipped
weight, SAPO's soft gate, and any a user registers (`register_policy_loss`, or `rl.policy_loss: module:function`).

A surrogate maps the token log-probs to a per-token loss and the importance ratio it used::

    fn(logp, old_logp, advantages, mask, *, epsilon_low, epsilon_high, dual_clip_c, **settings)
        -> (loss [B, T], ratio [B, T])

with ``advantages [B, T]``; ``settings`` are its own keywords (SAPO's ``tau_pos`` / ``tau_neg``), which a run gives
as ``rl.policy_loss_kwargs`` and which keep their defaults in the function's signature. A surrogate without a
dual clip is registered with ``dual_clip=False`` (the run's ``rl.loss.dual_clip_c`` must then be 0). Composition
with token selection, rollout correction, KL and entropy: ``jaxrl_llm.rl.policy_loss``.
"""

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array

from jaxrl_llm.rl.reductions import MAX_LOG_RATIO, as_float32, is_valid, masked_max, masked_mean, masked_min

PolicyLossFn = Callable[..., tuple[Array, Array]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}
NO_DUAL_CLIP: set[str] = set()  # registered surrogates without a dual clip


def register_policy_loss(name: str, *, dual_clip: bool = True) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: `@register_policy_loss("name")` adds `fn` (the signature above) to `POLICY_LOSSES`;
    `dual_clip=False` says it has no dual clip (a run's `rl.loss.dual_clip_c` must be 0 with it)."""
    def add(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSSES[name] = fn
        (NO_DUAL_CLIP.discard if dual_clip else NO_DUAL_CLIP.add)(name)
        return fn

    return add


def token_log_ratio(logp: Array, old_logp: Array, mask: Array) -> Array:
    """``log pi(y_t) - log pi_old(y_t)`` clipped to ``[-20, 20]``, 0 at padding. Shapes ``[B, T]`` -> ``[B, T]``."""
    log_ratio = jnp.where(is_valid(mask), as_float32(logp) - as_float32(old_logp), 0.0)
    return jnp.clip(log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO)


def broadcast_advantages(advantages: Array, logp: Array) -> Array:
    """One advantage per sequence ``[B]`` spread over its tokens, or per-token ``[B, T]`` as given:
    ``A_t = A`` for every ``t``. Shapes: ``advantages [B]`` or ``[B, T]``, ``logp [B, T]`` -> ``[B, T]`` float32."""
    adv = as_float32(advantages)
    if adv.ndim == logp.ndim - 1:
        adv = adv[..., None]
    return jnp.broadcast_to(adv, logp.shape)


def clipped_surrogate(
    ratio: Array,
    advantages: Array,
    *,
    epsilon_low: float | Array = 0.2,
    epsilon_high: float | Array = 0.2,
    dual_clip_c: float | None = None,
) -> Array:
    """Per-token PPO clipped surrogate *loss* (Schulman et al. 2017), asymmetric and optionally dual-clipped.

    ::

        l = -min(rho * A, clip(rho, 1 - epsilon_low, 1 + epsilon_high) * A)
        dual clip (Ye et al. 2019), for A < 0 only:  l = min(l, -c * A),  c > 1

    ``epsilon_high > epsilon_low`` is DAPO's clip-higher (Yu et al. 2025). Where the clipped branch is
    active the loss is constant in ``rho`` and the token contributes no gradient. ``dual_clip_c`` is static.

    Shapes: ``ratio``, ``advantages`` broadcastable, e.g. ``[B, T]`` -> ``[B, T]`` float32.
    """
    ratio = as_float32(ratio)
    adv = as_float32(advantages)
    unclipped = -ratio * adv
    clipped = -jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high) * adv
    loss = jnp.maximum(unclipped, clipped)
    if dual_clip_c is not None:
        if dual_clip_c <= 1.0:
            raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
        loss = jnp.where(adv < 0, jnp.minimum(loss, -dual_clip_c * adv), loss)
    return loss


def _with_ratio(ratio: Array, advantages: Array, epsilon_low: float | Array, epsilon_high: float | Array,
                dual_clip_c: float | None) -> tuple[Array, Array]:
    """``(clipped_surrogate(rho, A), rho)``: what a surrogate that clips its ratio ``rho`` returns."""
    return clipped_surrogate(ratio, advantages, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
                             dual_clip_c=dual_clip_c), ratio


@register_policy_loss("ppo_clip")
def ppo_clip_loss(logp: Array, old_logp: Array, advantages: Array, mask: Array, *,
                  epsilon_low: float | Array = 0.2, epsilon_high: float | Array = 0.2,
                  dual_clip_c: float | None = None) -> tuple[Array, Array]:
    """Token-level clipped surrogate (PPO, GRPO, DAPO, Dr.GRPO): ``rho_t = pi(y_t) / pi_old(y_t)``,
    ``l_t = clipped_surrogate(rho_t, A_t)``. Shapes: all ``[B, T]`` -> ``([B, T], [B, T])``."""
    ratio = jnp.exp(token_log_ratio(logp, old_logp, mask))
    return _with_ratio(ratio, advantages, epsilon_low, epsilon_high, dual_clip_c)


@register_policy_loss("gspo")
def gspo_loss(logp: Array, old_logp: Array, advantages: Array, mask: Array, *,
              epsilon_low: float | Array = 0.2, epsilon_high: float | Array = 0.2,
              dual_clip_c: float | None = None) -> tuple[Array, Array]:
    """Sequence-level clipped surrogate, GSPO (Zheng et al. 2025)::

        s_i   = exp(mean_t log(pi(y_t) / pi_old(y_t)))          over the valid tokens of sequence i
        rho_t = sg(s_i) * pi(y_t) / sg(pi(y_t))                  value s_i, gradient of log pi(y_t) scaled by s_i
        l_t   = clipped_surrogate(rho_t, A_t)

    With a sequence-level advantage and ``aggregation="seq-mean-token-mean"`` this is exactly GSPO's gradient.
    Shapes: all ``[B, T]`` -> ``([B, T], [B, T])``."""
    sg = jax.lax.stop_gradient
    seq_log_ratio = masked_mean(token_log_ratio(logp, old_logp, mask), mask, axis=-1, keepdims=True)
    ratio = jnp.exp(sg(seq_log_ratio) + jnp.where(is_valid(mask), as_float32(logp) - sg(as_float32(logp)), 0.0))
    return _with_ratio(ratio, advantages, epsilon_low, epsilon_high, dual_clip_c)


@register_policy_loss("cispo", dual_clip=False)
def cispo_loss(logp: Array, old_logp: Array, advantages: Array, mask: Array, *,
               epsilon_low: float | Array = 0.2, epsilon_high: float | Array = 0.2,
               dual_clip_c: float | None = None) -> tuple[Array, Array]:
    """CISPO, clipped importance-sampling-weight policy optimisation (MiniMax-M1, MiniMax 2025, arXiv:2506.13585)::

        rho_t = pi(y_t) / pi_old(y_t)
        w_t   = sg(clip(rho_t, 1 - epsilon_low, 1 + epsilon_high))
        l_t   = -w_t * A_t * log pi(y_t)            grad l_t = -w_t * A_t * grad log pi(y_t)

    The importance weight is clipped, not the update: every valid token with ``A_t != 0`` keeps a gradient
    (``ppo_clip`` drops the tokens on the clipped side), and inside the clip range the gradient is ``ppo_clip``'s.
    As verl's ``compute_policy_loss_cispo``. TRL's ``loss_type="cispo"`` clips only above, reading its
    ``epsilon_high`` as the bound itself (ScaleRL's ``eps_max = 5``): here that is ``epsilon_low >= 1`` (no lower
    bound, as ``rho > 0``) and ``epsilon_high = eps_max - 1``. The value weighs log-probs, so it is not comparable
    with ``ppo_clip``'s; only its gradient matters. No dual clip (``dual_clip_c`` must be None).
    Shapes: all ``[B, T]`` -> ``([B, T], [B, T])``."""
    if dual_clip_c is not None:
        raise ValueError("cispo clips the importance weight; it has no dual clip (dual_clip_c must be None)")
    valid = is_valid(mask)
    ratio = jnp.exp(token_log_ratio(logp, old_logp, mask))
    weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high))
    # Padded log-probs may be -inf; 0 there keeps 0 * (-inf) = nan out of the value and the gradient.
    return -weight * as_float32(advantages) * jnp.where(valid, as_float32(logp), 0.0), ratio


@register_policy_loss("sapo", dual_clip=False)
def sapo_loss(logp: Array, old_logp: Array, advantages: Array, mask: Array, *,
              epsilon_low: float | Array = 0.2, epsilon_high: float | Array = 0.2,
              dual_clip_c: float | None = None, tau_pos: float | Array = 1.0,
              tau_neg: float | Array = 1.05) -> tuple[Array, Array]:
    """SAPO, soft adaptive policy optimisation (Gao et al. 2025, arXiv:2511.20347): a smooth gate in place of the
    hard clip, with its own temperature for positive and negative advantages::

        tau_t = tau_pos if A_t > 0 else tau_neg
        f(r)  = sigmoid(tau_t * (r - 1)) * 4 / tau_t
        l_t   = -f(rho_t) * A_t                     grad l_t = -g_t * A_t * rho_t * grad log pi(y_t)
        g_t   = f'(rho_t) = 4 s (1 - s),  s = sigmoid(tau_t * (rho_t - 1))

    ``g = 1`` at ``rho = 1`` (the unclipped policy gradient there), and decays smoothly as ``rho`` leaves 1: a soft
    trust region, sharper for larger ``tau`` (``tau -> inf``: a hard gate that keeps only ``rho = 1``; ``tau -> 0``:
    the unclipped ``-rho A``). ``tau_neg > tau_pos`` damps the updates of negative tokens faster, which the paper
    finds more stable. As TRL's ``loss_type="sapo"`` (``sapo_temperature_pos`` / ``_neg``) and verl's
    ``compute_policy_loss_sapo`` (``tau_pos`` / ``tau_neg``); both recommend ``seq-mean-token-mean`` aggregation.
    ``epsilon_low`` / ``epsilon_high`` are not used; no dual clip (``dual_clip_c`` must be None).
    Shapes: all ``[B, T]`` -> ``([B, T], [B, T])``."""
    if dual_clip_c is not None:
        raise ValueError("sapo's gate replaces the clip; it has no dual clip (dual_clip_c must be None)")
    adv = as_float32(advantages)
    ratio = jnp.exp(token_log_ratio(logp, old_logp, mask))
    tau = jnp.where(adv > 0, jnp.asarray(tau_pos, jnp.float32), jnp.asarray(tau_neg, jnp.float32))
    gate = jax.nn.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return -gate * adv, ratio


def policy_surrogate(logp: Array, old_logp: Array, advantages: Array, mask: Array, *, surrogate: str = "ppo_clip",
                     epsilon_low: float | Array = 0.2, epsilon_high: float | Array = 0.2,
                     dual_clip_c: float | None = None,
                     settings: Mapping[str, Any] | None = None) -> tuple[Array, Array]:
    """The registered surrogate by name: ``(s_t, rho_t) = POLICY_LOSSES[surrogate](logp, old_logp, A, mask, ...)``,
    with ``settings`` its own keywords (SAPO's ``tau_pos`` / ``tau_neg``; a run's ``rl.policy_loss_kwargs``).
    Shapes: all ``[B, T]`` -> ``(loss [B, T], ratio [B, T])``. Static: ``surrogate``, ``dual_clip_c``, settings."""
    if surrogate not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {surrogate!r}; expected one of {', '.join(POLICY_LOSSES)}")
    return POLICY_LOSSES[surrogate](logp, old_logp, advantages, mask, epsilon_low=epsilon_low,
                                    epsilon_high=epsilon_high, dual_clip_c=dual_clip_c, **(settings or {}))


def clip_metrics(ratio: Array, token_log_ratio: Array, advantages: Array, mask: Array, *,
                 epsilon_low: float | Array, epsilon_high: float | Array,
                 dual_clip_c: float | None) -> dict[str, Array]:
    """Diagnostics of a clipped update, means over valid tokens (no gradient)::

        clip_fraction/low  = mean[A < 0 and rho < 1 - epsilon_low]
        clip_fraction/high = mean[A > 0 and rho > 1 + epsilon_high]
        clip_fraction/dual = mean[A < 0 and rho > c],  clip_fraction = low + high
        approx_kl = mean[rho_tok - 1 - log rho_tok]   (k3 estimate of KL(pi_old || pi) from the token log-ratios)
        ratio/mean, ratio/min, ratio/max

    Shapes: all ``[B, T]``."""
    r, tok_lr = jax.lax.stop_gradient(ratio), jax.lax.stop_gradient(token_log_ratio)
    low = (advantages < 0) & (r < 1.0 - epsilon_low)
    high = (advantages > 0) & (r > 1.0 + epsilon_high)
    dual = (advantages < 0) & (r > dual_clip_c) if dual_clip_c is not None else jnp.zeros_like(is_valid(mask))
    return {
        "clip_fraction": masked_mean(low | high, mask),
        "clip_fraction/low": masked_mean(low, mask),
        "clip_fraction/high": masked_mean(high, mask),
        "clip_fraction/dual": masked_mean(dual, mask),
        "approx_kl": masked_mean(jnp.exp(tok_lr) - 1.0 - tok_lr, mask),
        "ratio/mean": masked_mean(r, mask),
        "ratio/min": masked_min(r, mask),
        "ratio/max": masked_max(r, mask),
    }

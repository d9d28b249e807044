"""DPO-family preference losses (DPO, IPO, SLiC's hinge, SimPO) on summed sequence log-probs, with TRL's reward
metrics. Pure, jittable functions; the loss type is static. Shapes: ``[B]`` per pair.
"""

from typing import Literal

import jax
import jax.numpy as jnp
from jax import Array

from jaxrl_llm.rl.options import PREFERENCE_LOSSES
from jaxrl_llm.rl.reductions import as_float32, masked_mean

PreferenceLossType = Literal["sigmoid", "ipo", "hinge", "simpo"]


def preference_scores(
    policy_chosen_logp: Array, policy_rejected_logp: Array, ref_chosen_logp: Array, ref_rejected_logp: Array, *,
    loss_type: PreferenceLossType = "sigmoid", chosen_lengths: Array | None = None,
    rejected_lengths: Array | None = None,
) -> tuple[Array, Array]:
    """What a DPO-family loss compares per response: the log-ratio to the reference, or SimPO's length-normalised
    log-prob (reference-free)::

        z = log pi(y) - log pi_ref(y)          z = log pi(y) / max(|y|, 1)   (loss_type="simpo")

    Shapes: log-probs and lengths ``[B]`` -> ``(z_chosen [B], z_rejected [B])`` float32. Static: ``loss_type``."""
    if loss_type == "simpo":
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError("loss_type='simpo' needs chosen_lengths and rejected_lengths")
        chosen = as_float32(policy_chosen_logp) / jnp.maximum(as_float32(chosen_lengths), 1.0)
        rejected = as_float32(policy_rejected_logp) / jnp.maximum(as_float32(rejected_lengths), 1.0)
    else:
        chosen = as_float32(policy_chosen_logp) - as_float32(ref_chosen_logp)
        rejected = as_float32(policy_rejected_logp) - as_float32(ref_rejected_logp)
    return chosen, rejected


def preference_pair_loss(h: Array, *, beta: Array, label_smoothing: Array, loss_type: PreferenceLossType = "sigmoid",
                         simpo_gamma: float | Array = 0.5) -> Array:
    """Per-pair DPO-family loss of the margin ``h = z_chosen - z_rejected`` (`preference_scores`), ``eps`` the
    label smoothing:

    * ``sigmoid`` (DPO, Rafailov et al. 2023; label smoothing = conservative DPO, Mitchell 2023)::

          l = -(1 - eps) * log sigmoid(beta * h) - eps * log sigmoid(-beta * h)

    * ``ipo`` (Azar et al. 2023): ``l = (h - 1 / (2 * beta))^2`` (IPO's ``tau`` is ``beta`` here; TRL feeds
      length-averaged log-probs to IPO; pass those if that is wanted).
    * ``hinge`` (SLiC, Zhao et al. 2023): ``l = max(0, 1 - beta * h)``.
    * ``simpo`` (SimPO, Meng et al. 2024), ``h`` the difference of length-normalised log-probs::

          l = -(1 - eps) * log sigmoid(beta * h - gamma) - eps * log sigmoid(gamma - beta * h)

    Shapes: ``h [B]``, ``beta``, ``label_smoothing`` float32 scalars -> ``[B]`` float32. Static: ``loss_type``."""
    eps = label_smoothing
    if loss_type == "sigmoid":
        return -(1.0 - eps) * jax.nn.log_sigmoid(beta * h) - eps * jax.nn.log_sigmoid(-beta * h)
    if loss_type == "simpo":
        z = beta * h - jnp.asarray(simpo_gamma, jnp.float32)
        return -(1.0 - eps) * jax.nn.log_sigmoid(z) - eps * jax.nn.log_sigmoid(-z)
    if loss_type == "ipo":
        return jnp.square(h - 1.0 / (2.0 * beta))
    if loss_type == "hinge":
        return jax.nn.relu(1.0 - beta * h)
    raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {', '.join(PREFERENCE_LOSSES)}")


def dpo_loss(
    policy_chosen_logp: Array, policy_rejected_logp: Array, ref_chosen_logp: Array, ref_rejected_logp: Array, *,
    beta: float | Array = 0.1, loss_type: PreferenceLossType = "sigmoid", label_smoothing: float | Array = 0.0,
    mask: Array | None = None, chosen_lengths: Array | None = None, rejected_lengths: Array | None = None,
    simpo_gamma: float | Array = 0.5,
) -> tuple[Array, dict[str, Array]]:
    """DPO-family preference losses on summed sequence log-probs, with reward metrics::

        z     = preference_scores(...)             log pi - log pi_ref  (SimPO: log pi / |y|, reference-free)
        l     = preference_pair_loss(z_w - z_l)    sigmoid (DPO), ipo, hinge (SLiC) or simpo
        loss  = mean over valid pairs of l

    The implicit rewards are ``beta * z`` per response. Metrics (means over valid pairs, no gradient): ``loss``,
    ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies`` (fraction with chosen
    reward strictly above rejected), ``logps/chosen``, ``logps/rejected`` (TRL's names).

    Shapes: all four log-prob inputs ``[B]`` (sums over each response's tokens; ``masked_sum(..., axis=-1)``
    of token log-probs), optional ``mask [B]`` for padding pairs, lengths ``[B]`` (SimPO's, required there).
    Returns ``(loss, metrics)``.
    """
    beta = jnp.asarray(beta, jnp.float32)
    eps = jnp.asarray(label_smoothing, jnp.float32)
    chosen, rejected = preference_scores(policy_chosen_logp, policy_rejected_logp, ref_chosen_logp,
                                         ref_rejected_logp, loss_type=loss_type, chosen_lengths=chosen_lengths,
                                         rejected_lengths=rejected_lengths)
    h = chosen - rejected
    per_pair = preference_pair_loss(h, beta=beta, label_smoothing=eps, loss_type=loss_type, simpo_gamma=simpo_gamma)
    pair_mask = jnp.ones_like(h) if mask is None else mask
    loss = masked_mean(per_pair, pair_mask)
    chosen_reward = beta * chosen
    rejected_reward = beta * rejected
    metrics = {
        "loss": loss,
        "rewards/chosen": masked_mean(chosen_reward, pair_mask),
        "rewards/rejected": masked_mean(rejected_reward, pair_mask),
        "rewards/margins": masked_mean(chosen_reward - rejected_reward, pair_mask),
        "rewards/accuracies": masked_mean(chosen_reward > rejected_reward, pair_mask),
        "logps/chosen": masked_mean(policy_chosen_logp, pair_mask),
        "logps/rejected": masked_mean(policy_rejected_logp, pair_mask),
    }
    return loss, {k: jax.lax.stop_gradient(m) for k, m in metrics.items()}

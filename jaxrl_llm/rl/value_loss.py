"""PPO's critic: the clipped value loss and the explained variance of its values.

Pure, jittable functions of float32 arrays. Shapes: ``[B, T]`` with ``mask [B, T]`` (1 = completion token).
"""

import jax
import jax.numpy as jnp
from jax import Array

from jaxrl_llm.rl.reductions import AggregationMode, aggregate_loss, as_float32, masked_mean, masked_var


def explained_variance(values: Array, returns: Array, mask: Array) -> Array:
    """``1 - Var[R - V] / Var[R]`` over valid tokens (population variances), float32 scalar.

    1 is a perfect critic, 0 no better than a constant, negative worse. When ``Var[R] = 0`` it is 1 if
    the residual variance is 0 too and 0 otherwise (scikit-learn's convention), never NaN.

    Shapes: ``values``, ``returns``, ``mask`` ``[B, T]``.
    """
    var_returns = masked_var(returns, mask)
    var_residual = masked_var(as_float32(returns) - as_float32(values), mask)
    ratio = var_residual / jnp.where(var_returns > 0, var_returns, 1.0)
    return jnp.where(var_returns > 0, 1.0 - ratio, jnp.where(var_residual > 0, 0.0, 1.0))


def clipped_value_loss(
    values: Array, old_values: Array, returns: Array, mask: Array, *, clip_range: float | None = 0.2,
    aggregation: AggregationMode = "token-mean", max_len: int | None = None, num_tokens: Array | float | None = None,
    num_seqs: Array | float | None = None,
) -> tuple[Array, dict[str, Array]]:
    """PPO critic loss with value clipping (Schulman et al. 2017; as in OpenAI baselines' PPO2).

    ::

        V_clip = clip(V, V_old - clip_range, V_old + clip_range)
        l_t    = 0.5 * max((V - R)^2, (V_clip - R)^2)        (0.5 * (V - R)^2 if clip_range is None)
        loss   = aggregate(l, mask, aggregation)

    The clip is written as verl writes it: a ``V`` inside the range is ``V_clip`` itself, bit for bit (``V_old +
    (V - V_old)`` is not, in float32, and would count tokens as clipped that are not).

    Metrics: ``value_loss``, ``value_clip_fraction`` (tokens where the clipped term is the larger),
    ``explained_variance`` of the current ``values`` against ``returns``, ``value/mean``.

    Shapes: ``values``, ``old_values``, ``returns``, ``mask`` ``[B, T]``. Returns ``(loss, metrics)``.
    """
    v = as_float32(values)
    target = as_float32(returns)
    unclipped = jnp.square(v - target)
    if clip_range is None:
        per_token = 0.5 * unclipped
        clipped_frac = jnp.zeros((), jnp.float32)
    else:
        v_old = as_float32(old_values)
        v_clip = jnp.clip(v, v_old - clip_range, v_old + clip_range)
        clipped = jnp.square(v_clip - target)
        per_token = 0.5 * jnp.maximum(unclipped, clipped)
        clipped_frac = masked_mean(clipped > unclipped, mask)
    loss = aggregate_loss(per_token, mask, aggregation, max_len=max_len, num_tokens=num_tokens, num_seqs=num_seqs)
    metrics = {
        "value_loss": loss,
        "value_clip_fraction": clipped_frac,
        "explained_variance": explained_variance(v, target, mask),
        "value/mean": masked_mean(v, mask),
    }
    return loss, {k: jax.lax.stop_gradient(m) for k, m in metrics.items()}

"""On-policy distillation's math: the per-token reverse-KL signal and GKD's generalised Jensen-Shannon divergence.

**Reverse KL on the student's samples** (on-policy distillation, as in Qwen3's small models and Thinking Machines'
"On-Policy Distillation"): the student samples `y ~ pi_theta`; the teacher scores every sampled token; the
per-token estimate of `KL(pi_theta || pi_T)` at `y_t` is `log pi_theta(y_t) - log pi_T(y_t)`, and its negative is
the token's advantage in an ordinary importance-sampled policy gradient (no discount: each token is credited with
its own term only). Minimising `E_y[sum_t log pi_theta(y_t) - log pi_T(y_t)]` is mode-seeking: the student learns
to put its mass where the teacher does, on its own states.

**Generalised JSD** (GKD, Agarwal et al. 2024; TRL's `GKDTrainer.generalized_jsd_loss`): over the full vocabulary
at each position, with `p_S = softmax(z_S / tau)`, `p_T = softmax(z_T / tau)` and the mixture
`m = beta p_T + (1 - beta) p_S`::

    JSD_beta(p_T, p_S) = beta KL(p_T || m) + (1 - beta) KL(p_S || m)        0 < beta < 1
                       = KL(p_T || p_S)  (forward KL)                        beta = 0
                       = KL(p_S || p_T)  (reverse KL)                        beta = 1

(the endpoints as TRL defines them; the mixture form itself vanishes there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array, lax

from jaxrl_llm.models.layers import softcap
from jaxrl_llm.models.precision import matmul, matmul_transposed
from jaxrl_llm.rl.logprobs import _map_over_time_chunks


def reverse_kl_advantages(student_logp: Array, teacher_logp: Array, mask: Array, *, coef: float = 1.0) -> Array:
    """Per-token advantages of on-policy distillation: `A_t = coef * (log pi_T(y_t) - log pi_S(y_t)) * m_t`.

    `student_logp` is the log-prob the sample was drawn with (the old policy's); the gradient of the importance-
    sampled surrogate `-A_t pi_theta(y_t) / pi_old(y_t)` at `theta = old` is that of the reverse KL
    `sum_t log pi_theta(y_t) - log pi_T(y_t)` with each token's term as its own reward.

    Shapes: `student_logp, teacher_logp, mask [N, T]` -> `[N, T]` float32 (0 at padding).
    """
    m = mask.astype(jnp.float32)
    return coef * (teacher_logp.astype(jnp.float32) - student_logp.astype(jnp.float32)) * m


def generalized_jsd(student_logits: Array, teacher_logits: Array, *, beta: float, temperature: float = 1.0) -> Array:
    """`JSD_beta(p_T, p_S)` at every position (module docstring), float32.

    Shapes: `student_logits, teacher_logits [..., V]` -> `[...]`. `beta` is static (its endpoints are other
    formulas); the teacher's logits carry no gradient.
    """
    log_s = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
    log_t = jax.nn.log_softmax(lax.stop_gradient(teacher_logits).astype(jnp.float32) / temperature, axis=-1)

    def kl(log_p: Array, log_q: Array) -> Array:  # KL(p || q) over the vocabulary
        return (jnp.exp(log_p) * (log_p - log_q)).sum(axis=-1)

    if beta == 0.0:
        return kl(log_t, log_s)
    if beta == 1.0:
        return kl(log_s, log_t)
    log_m = jnp.logaddexp(log_s + jnp.log1p(-beta), log_t + jnp.log(beta))
    return beta * kl(log_t, log_m) + (1.0 - beta) * kl(log_s, log_m)


def generalized_jsd_from_hidden(
    student_hidden: Array, student_unembed: Array, teacher_hidden: Array, teacher_unembed: Array, *, beta: float,
    temperature: float = 1.0, chunk_size: int = 128, student_softcap: float | None = None,
    teacher_softcap: float | None = None, compute_dtype: jnp.dtype | str | None = None,
    student_transposed: bool = False, teacher_transposed: bool = False,
) -> Array:
    """`generalized_jsd` of the logits `hidden @ unembed` of a student and a teacher, `chunk_size` positions at a
    time (only `[N, chunk, V]` float32 logits of each live at once, recomputed in the backward pass), as
    `token_logprobs_from_hidden` does for log-probs.

    Shapes: `student_hidden [N, T, D_S]`, `student_unembed [D_S, V]`, `teacher_hidden [N, T, D_T]`,
    `teacher_unembed [D_T, V]` -> `[N, T]` float32. `student_transposed` / `teacher_transposed`: that unembedding
    is `[V, D]` (a tied embedding as stored) and multiplied transposed, as `token_logprobs_from_hidden`'s
    `unembed_transposed` (XLA:CPU runs a dot by a transposed view in float32).
    """
    time_axis = student_hidden.ndim - 2
    s_dtype = student_unembed.dtype if compute_dtype is None else compute_dtype

    def block(start: Array | int, size: int) -> tuple[Array]:
        hs = lax.dynamic_slice_in_dim(student_hidden, start, size, axis=time_axis)
        ht = lax.dynamic_slice_in_dim(teacher_hidden, start, size, axis=time_axis)
        zs = (matmul_transposed if student_transposed else matmul)(hs, student_unembed, s_dtype, jnp.float32)
        zt = (matmul_transposed if teacher_transposed else matmul)(ht, teacher_unembed, teacher_unembed.dtype,
                                                                   jnp.float32)
        zs, zt = softcap(zs, student_softcap), softcap(zt, teacher_softcap)
        return (generalized_jsd(zs, zt, beta=beta, temperature=temperature),)

    return _map_over_time_chunks(block, student_hidden.shape[time_axis], chunk_size, 1)[0]

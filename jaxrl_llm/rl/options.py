"""The RL math's static options: the choices its functions accept (KL estimators, loss aggregations, rollout
corrections, preference and distillation losses) and `PolicyLossOptions`, the policy loss's frozen (hashable,
jit-static) options. The run's config (`jaxrl_llm.config.schema`) uses them as they are: `rl.loss` is a
`PolicyLossOptions`, and each field's allowed values (`jaxrl_llm.fields`) are checked with the config's. A field's
comment is its help in `--print-config` and docs/config-reference.md."""

from __future__ import annotations

from dataclasses import dataclass

from jaxrl_llm.fields import at_least, finite, fraction, one_of, positive, within

KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
# rl.loss.rollout_correction: where the old policy's log-probs come from (see PolicyLossOptions)
ROLLOUT_CORRECTIONS = ("none", "recompute", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
PREFERENCE_LOSSES = ("sigmoid", "ipo", "hinge", "simpo")  # dpo.loss (jaxrl_llm.rl.preference)
DISTILL_LOSSES = ("reverse_kl", "jsd")  # distill.loss (jaxrl_llm.rl.distillation)


@dataclass(frozen=True)
class PolicyLossOptions:
    """`rl.loss`: the policy loss's options for every surrogate, one frozen (hashable, jit-static) object that
    `jaxrl_llm.rl.policy_loss.clipped_policy_loss` takes as it is: the clip range, the KL estimator, the aggregation,
    token selection (top entropy, Clip-Cov, KL-Cov) and the rollout correction. The surrogate itself and its own
    keywords are `rl.policy_loss` and `rl.policy_loss_kwargs`; the coefficients (`rl.beta`, `rl.entropy_coef`)
    may be traced and stay in `rl`."""

    epsilon_low: float = at_least(0.2)  # ratio clip range below 1 (PPO epsilon)
    epsilon_high: float = at_least(0.2)  # ratio clip range above 1 (DAPO clip-higher: 0.28)
    dual_clip_c: float = at_least(0.0)  # dual clip of ppo_clip / gspo for A < 0 (Ye et al. 2019): 0 = off; else > 1
    kl_estimator: str = one_of("k3", KL_ESTIMATORS)  # k1 | k2 | k3 (Schulman's estimators of the KL term)
    # token-mean | seq-mean-token-mean | seq-mean-token-sum(-norm)
    aggregation: str = one_of("token-mean", LOSS_AGGREGATIONS)
    # < 1: the policy gradient only on this fraction of each batch's valid tokens, those of highest entropy
    # ("Beyond the 80/20 rule": 0.2); 1 = every token
    top_entropy_quantile: float = within(1.0, 0.0, 1.0, low_open=True)
    # > 0: Clip-Cov (Cui et al. 2025): detach the gradient of this fraction of the tokens (at least 1), those of
    # highest covariance of log-prob and advantage within (clip_cov_lb, clip_cov_ub); 0 = off (verl: 0.0002)
    clip_cov_ratio: float = fraction(0.0)
    clip_cov_lb: float = finite(1.0)  # Clip-Cov: lower bound of the covariance of the tokens it may detach
    clip_cov_ub: float = finite(5.0)  # Clip-Cov: upper bound of the covariance of the tokens it may detach
    # > 0: KL-Cov (Cui et al. 2025): add kl_cov_coef * |log pi - log pi_old| to the loss of this fraction of the
    # tokens (at least 1), those of highest covariance of log-prob and advantage; 0 = off (verl: 0.0002)
    kl_cov_ratio: float = fraction(0.0)
    # KL-Cov: the penalty's coefficient (the paper's recipes; verl ppo_kl_coef, 0.1 there)
    kl_cov_coef: float = at_least(1.0)
    # The old policy's log-probs and the sampler / trainer mismatch (GRPO family and PPO):
    # none = the sampler's log-probs are the old policy's (no extra pass);
    # recompute = the trainer's forward recomputes them before the update (verl's default);
    # token_truncate | token_mask | sequence_truncate | sequence_mask = recompute, and weight the policy-gradient
    # term by the importance ratio pi_old / pi_sampler per token or per sequence, truncated at
    # rollout_correction_cap or masked (0) above it (TRL's vllm_importance_sampling_mode, verl's rollout_is)
    rollout_correction: str = one_of("none", ROLLOUT_CORRECTIONS)
    rollout_correction_cap: float = positive(3.0)  # C of the *_truncate / *_mask modes (TRL's default)

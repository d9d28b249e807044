"""Named symptoms of an RL run, read from its per-step metrics: pure functions over host floats.

Where `jaxrl_llm.run.divergence` stops a run that has collapsed, these are warnings: each symptom is named in the
log with a one-line hint when it starts, and logged as the metric `diagnostics/<name>` = 1 on every step it
holds (`diagnostics/count`: how many hold, every step). The baseline of the ratios below is the mean over the
first `baseline_steps` steps of the run.

    empty_completions     frac_empty >= empty_fraction                  (completions with no text)
    all_truncated         frac_truncated >= 1                           (every completion hit max_new_tokens)
    reward_zero           reward/mean == 0 and reward/std == 0 for `reward_steps` steps
    reward_constant       reward/std == 0 and reward/mean unchanged (!= 0) for `reward_steps` steps
    entropy_collapse      entropy < entropy_ratio * baseline entropy   (and the reward no better than baseline)
    kl_blowup             kl (to the reference) or drift_kl (to the initial policy) > kl_max nats/token
    length_collapse       completion_length/mean < length_low * baseline   (and the reward no better)
    length_explosion      completion_length/mean > length_high * baseline
    repetition            repetition/ngram_frac >= repetition           (share of repeated n-grams)
    zero_variance_groups  frac_zero_std_groups >= zero_std_groups for `patience` steps
    throughput_drop       median tokens/s of the last `throughput_window` steps < throughput_ratio * the median
                          of the steps before them (after the baseline steps, which compile)

`repeated_ngram_fraction` computes the repetition metric of a batch of completions, `drift_kl` the KL of the
policy to its initial weights (logged as `drift_kl` at evaluation steps, whatever rl.beta is).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

KL_TERM_MAX = 10.0  # drift_kl's per-token clip

HINTS: dict[str, str] = {
    "empty_completions": "the policy ends at once (EOS first); check the prompt format / chat template and "
                         "sampling.max_new_tokens, or lower the learning rate",
    "all_truncated": "no completion reaches EOS; raise sampling.max_new_tokens, or check eos ids / the chat "
                     "template, or add an overlong penalty",
    "reward_zero": "no completion ever scores; test the reward function on samples.jsonl, or start from a model "
                   "that solves some prompts (SFT first)",
    "reward_constant": "every completion scores alike, so advantages are 0; check the reward function's range "
                       "or raise sampling.temperature",
    "entropy_collapse": "the policy became near-deterministic without gaining reward; lower "
                        "optim.learning_rate, raise rl.beta or rl.entropy_coef",
    "kl_blowup": "the policy runs away from the reference/initial model; lower optim.learning_rate or raise "
                 "rl.beta",
    "length_collapse": "completions shrink to nothing without gaining reward; check for a length-rewarding "
                       "shortcut, lower optim.learning_rate",
    "length_explosion": "completions grow far past their start; check rl.loss_aggregation (token-mean "
                        "favours long answers) and add an overlong penalty",
    "repetition": "completions repeat themselves (degenerate loops); lower optim.learning_rate, raise "
                  "rl.beta, or add a repetition penalty reward",
    "zero_variance_groups": "most groups score alike (task too easy or too hard): no learning signal; use "
                            "harder/easier prompts, raise rl.group_size, or rl.dynamic_sampling",
    "throughput_drop": "rollout tokens/s fell; another process shares the machine, the completions hit a "
                       "larger compile bucket, or memory is swapping",
}


@dataclasses.dataclass(frozen=True)
class DiagnosticLimits:
    """Thresholds of the symptoms (see the module docstring); `enabled=False` turns them all off."""

    enabled: bool = True
    baseline_steps: int = 3
    patience: int = 5
    empty_fraction: float = 0.5
    reward_steps: int = 10
    entropy_ratio: float = 0.1
    kl_max: float = 1.0
    length_low: float = 0.25
    length_high: float = 4.0
    repetition: float = 0.5
    zero_std_groups: float = 0.95
    throughput_ratio: float = 0.5
    throughput_window: int = 10


def repeated_ngram_fraction(tokens: np.ndarray, mask: np.ndarray, n: int = 3) -> float:
    """The share of repeated n-grams over a batch of completions `tokens, mask [B, T]`:

        sum_rows (grams - distinct grams) / sum_rows grams

    with a row's grams the `len - n + 1` windows of its masked tokens (rows shorter than `n`: none); 0 when
    no row has a gram. A completion looping over one token scores near 1, a varied one 0."""
    repeated = total = 0
    for row, m in zip(np.asarray(tokens), np.asarray(mask, bool), strict=True):
        seq = row[m].tolist()
        grams = [tuple(seq[i : i + n]) for i in range(len(seq) - n + 1)]
        repeated += len(grams) - len(set(grams))
        total += len(grams)
    return repeated / total if total else 0.0


def drift_kl(logp: np.ndarray, initial_logp: np.ndarray, mask: np.ndarray) -> float:
    """KL(pi || pi_initial) per token, the k3 estimate on tokens sampled from pi: with `d = initial_logp - logp`
    (`[N, T]`, masked by `mask`),

        drift_kl = sum(mask * min(exp(d) - d - 1, KL_TERM_MAX)) / sum(mask)

    (every term >= 0, unbiased for the KL before the clip; 0 when the two policies agree; 0 for an empty
    mask). Each term is clipped at `KL_TERM_MAX` = 10, as verl's low_var_kl: the rollout was sampled just
    before the update, and after a wild update one token's `exp(d)` would overflow the mean."""
    mask = np.asarray(mask, np.float64)
    d = (np.asarray(initial_logp, np.float64) - np.asarray(logp, np.float64)) * mask
    total = mask.sum()
    terms = np.minimum(np.exp(np.minimum(d, 50.0)) - d - 1.0, KL_TERM_MAX)
    return float((mask * terms).sum() / total) if total else 0.0


def _series(history: Sequence[dict[str, float]], key: str) -> list[float]:
    return [float(h[key]) for h in history if key in h and h[key] is not None and math.isfinite(float(h[key]))]


def _baseline(history: Sequence[dict[str, float]], key: str, steps: int) -> float | None:
    values = _series(history[:steps], key)
    return float(np.mean(values)) if values else None


def _streak(history: Sequence[dict[str, float]], holds: object) -> int:
    """How many of the last steps in a row `holds(metrics)` is true for."""
    count = 0
    for h in reversed(history):
        if not holds(h):  # type: ignore[operator]
            break
        count += 1
    return count


def diagnose(history: Sequence[dict[str, float]], limits: DiagnosticLimits = DiagnosticLimits()) -> dict[str, str]:
    """The symptoms that hold at the last step of `history` (one metrics dict per step, oldest first), each
    with a description naming its numbers. Pure: the same history gives the same answer."""
    if not limits.enabled or not history:
        return {}
    m, out = history[-1], {}
    b = limits.baseline_steps
    warmed_up = len(history) > b
    reward_base = _baseline(history, "reward/mean", b)
    reward_now = float(np.mean(_series(history[-b:], "reward/mean"))) if _series(history[-b:], "reward/mean") \
        else None
    no_gain = reward_base is None or reward_now is None or reward_now <= reward_base + 1e-9

    if m.get("frac_empty", 0.0) >= limits.empty_fraction:
        out["empty_completions"] = f"{m['frac_empty']:.0%} of the completions are empty"
    if m.get("frac_truncated", 0.0) >= 1.0:
        out["all_truncated"] = "every completion was cut at sampling.max_new_tokens"
    if "reward/mean" in m and "reward/std" in m:
        zero = _streak(history, lambda h: h.get("reward/mean") == 0.0 and h.get("reward/std") == 0.0)
        if zero >= limits.reward_steps:
            out["reward_zero"] = f"every completion scored 0 for {zero} steps"
        elif m["reward/std"] == 0.0:
            value = m["reward/mean"]
            same = _streak(history, lambda h: h.get("reward/std") == 0.0 and h.get("reward/mean") == value)
            if same >= limits.reward_steps:
                out["reward_constant"] = f"every completion scored {value:.4g} for {same} steps"
    entropy_base = _baseline(history, "entropy", b)
    if warmed_up and entropy_base and "entropy" in m and no_gain and m["entropy"] < limits.entropy_ratio * entropy_base:
        out["entropy_collapse"] = (f"entropy {m['entropy']:.3g} < {limits.entropy_ratio:g} x its start "
                                   f"{entropy_base:.3g} nats/token, reward no better")
    for key, what in (("kl", "KL to the reference"), ("drift_kl", "drift KL to the initial policy")):
        value = m.get(key)
        if value is not None and (not math.isfinite(value) or value > limits.kl_max):
            out["kl_blowup"] = f"{what} {value:.3g} > {limits.kl_max:g} nats/token"
            break
    length_base = _baseline(history, "completion_length/mean", b)
    length = m.get("completion_length/mean")
    if warmed_up and length_base and length is not None:
        if no_gain and length < limits.length_low * length_base:
            out["length_collapse"] = (f"mean completion length {length:.3g} < {limits.length_low:g} x its start "
                                      f"{length_base:.3g} tokens, reward no better")
        if length > limits.length_high * length_base:
            out["length_explosion"] = (f"mean completion length {length:.3g} > {limits.length_high:g} x its start "
                                       f"{length_base:.3g} tokens")
    if m.get("repetition/ngram_frac", 0.0) >= limits.repetition:
        out["repetition"] = f"{m['repetition/ngram_frac']:.0%} of the completions' 3-grams are repeats"
    if "frac_zero_std_groups" in m:
        flat = _streak(history, lambda h: h.get("frac_zero_std_groups", 0.0) >= limits.zero_std_groups)
        if flat >= limits.patience:
            out["zero_variance_groups"] = (f"{m['frac_zero_std_groups']:.0%} of the groups had one score for all "
                                           f"completions, {flat} steps in a row")
    speeds = _series(history[b:], "tokens_per_second")  # the first steps compile
    w = limits.throughput_window
    if len(speeds) >= 2 * w:
        earlier, recent = float(np.median(speeds[:-w])), float(np.median(speeds[-w:]))
        if recent < limits.throughput_ratio * earlier:
            out["throughput_drop"] = (f"median rollout throughput {recent:.4g} tokens/s over the last {w} steps, "
                                      f"down from {earlier:.4g}")
    return out


def diagnostic_metrics(found: dict[str, str]) -> dict[str, float]:
    """`diagnostics/<name>` = 1 for each symptom found, and `diagnostics/count`."""
    return {"diagnostics/count": float(len(found)), **{f"diagnostics/{name}": 1.0 for name in found}}


def describe(name: str, detail: str) -> str:
    """The log line of a symptom: its name, its numbers and the hint."""
    return f"diagnostic {name}: {detail}; hint: {HINTS[name]}"

"""The run's health monitor: one table of named checks over the per-step metrics, pure functions over host floats.

Each check has a name, an action and a hint. The shell's `Monitor` runs them all after every step:

    warn   a warning: a log line with its numbers and hint when it starts (`diagnostics/<name>` = 1 on every step
           it holds, `diagnostics/count`; its steps in summary.json under "diagnostics"); `monitor.warnings`
    stop   a divergence: a collapse that holds `monitor.patience` steps in a row, and did not hold at the run's
           first step (its baseline: a random model's near-uniform output is not a collapse); the conditions a
           converged policy can also meet count only while the mean reward is no better than at the first step.
           `monitor.on_divergence=stop` ends the run with the last good checkpoint and no export; `warn` logs it.

    name                   action  condition
    entropy_collapsed      stop    entropy < entropy_floor                               (one answer, no gain)
    entropy_uniform        stop    entropy > entropy_ceiling * log V                     (noise over the vocabulary)
    kl_exploded            stop    KL(pi || pi_ref) per token > kl_max
    reward_stuck           stop    every completion scored the same as in the previous step          (no gain)
    completions_empty      stop    every completion is empty (at most the EOS token)                 (no gain)
    completions_truncated  stop    every completion hit max_new_tokens                               (no gain)
    skipped_updates        stop    max_skipped_updates updates in a row skipped for non-finite gradients (always stops)
    no_learning_signal     warn    a zero gradient, or no group whose completions scored differently (every 10 steps)
    truncated              warn    frac_truncated >= truncated_fraction                  (once a run)
    empty_completions      warn    frac_empty >= empty_fraction
    all_truncated          warn    frac_truncated >= 1
    reward_zero            warn    reward/mean == 0 and reward/std == 0 for reward_steps steps
    reward_constant        warn    reward/std == 0 and reward/mean unchanged (!= 0) for reward_steps steps
    entropy_collapse       warn    entropy < entropy_ratio * baseline entropy            (no gain)
    kl_blowup              warn    kl (to the reference) or drift_kl (to the initial policy) > kl_warn
    length_collapse        warn    completion_length/mean < length_low * baseline        (no gain)
    length_explosion       warn    completion_length/mean > length_high * baseline
    repetition             warn    repetition/ngram_frac >= repetition
    zero_variance_groups   warn    frac_zero_std_groups >= zero_std_groups for `patience` steps
    throughput_drop        warn    median tokens/s of the last throughput_window steps < throughput_ratio * before

The baseline of the ratios is the mean over the first `baseline_steps` steps. `repeated_ngram_fraction` and
`drift_kl` compute two of the metrics the checks read.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np

from jaxrl_llm.config import MonitorSection

KL_TERM_MAX = 10.0  # drift_kl's per-token clip
NO_SIGNAL_REPEAT = 10  # a run of steps without learning signal is named at its first step and every N after
History = Sequence[dict[str, float]]


@dataclasses.dataclass(frozen=True)
class View:
    """What a check reads: the metrics so far (`history[-1]` is this step's), the settings, the vocabulary size,
    the previous step's mean reward (kept across a resume) and whether the update had a learning signal."""

    history: History
    settings: MonitorSection
    vocab_size: int = 2
    last_reward: float | None = None
    no_signal: bool = False

    @property
    def now(self) -> dict[str, float]:
        return self.history[-1]

    def series(self, key: str, steps: slice = slice(None)) -> list[float]:
        return [float(h[key]) for h in self.history[steps]
                if key in h and h[key] is not None and math.isfinite(float(h[key]))]

    def baseline(self, key: str) -> float | None:
        values = self.series(key, slice(None, self.settings.baseline_steps))
        return float(np.mean(values)) if values else None

    def warmed_up(self) -> bool:
        return len(self.history) > self.settings.baseline_steps

    def streak(self, holds: Callable[[dict[str, float]], bool]) -> int:
        """How many of the last steps in a row `holds(metrics)` is true for."""
        count = 0
        for h in reversed(self.history):
            if not holds(h):
                break
            count += 1
        return count

    def no_gain(self) -> bool:
        """The mean reward of the last baseline_steps steps is no better than over the first ones."""
        b = self.settings.baseline_steps
        base, recent = self.baseline("reward/mean"), self.series("reward/mean", slice(-b, None))
        return base is None or not recent or float(np.mean(recent)) <= base + 1e-9


@dataclasses.dataclass(frozen=True)
class Check:
    """One named check: `condition(view)` is the description (with its numbers) when it holds at this step."""

    name: str
    action: Literal["warn", "stop"]
    condition: Callable[[View], str | None]
    hint: str = ""
    needs_no_gain: bool = False  # stop checks: a converged policy may meet it too; counts only without reward gain


# ---------------------------------------------------------------------------------------------- the conditions

def _entropy_collapsed(v: View) -> str | None:
    e = v.now.get("entropy")
    if e is not None and math.isfinite(e) and e < v.settings.entropy_floor:
        return f"entropy {e:.4g} < {v.settings.entropy_floor:g} nats/token"
    return None


def _entropy_uniform(v: View) -> str | None:
    e, ceiling = v.now.get("entropy"), v.settings.entropy_ceiling * math.log(v.vocab_size)
    if e is not None and math.isfinite(e) and e > ceiling:
        return (f"entropy {e:.4g} > {v.settings.entropy_ceiling:g} * log V = {ceiling:.4g} nats/token "
                f"(near-uniform output)")
    return None


def _kl_exploded(v: View) -> str | None:
    kl = v.now.get("kl")
    if kl is not None and (not math.isfinite(kl) or kl > v.settings.kl_max):
        return f"KL to the reference {kl:.4g} > {v.settings.kl_max:g} nats/token"
    return None


def _reward_stuck(v: View) -> str | None:
    reward, std = v.now.get("reward/mean"), v.now.get("reward/std")
    if v.settings.reward_stuck and reward is not None and std == 0.0 and v.last_reward == reward:
        return f"every completion scored {reward:.4g}, as in the previous step"
    return None


def _completions_empty(v: View) -> str | None:
    return "every completion is empty" if v.now.get("completion_length/max", 2.0) <= 1.0 else None


def _all_truncated(v: View) -> str | None:
    return "every completion was cut at sampling.max_new_tokens" if v.now.get("frac_truncated", 0.0) >= 1.0 else None


def _skipped_updates(v: View) -> str | None:
    n = v.streak(lambda h: bool(h.get("monitor/skipped", 0.0)))
    if n >= v.settings.max_skipped_updates:
        return f"the last {n} steps had non-finite gradients and were skipped"
    return None


def _no_learning_signal(v: View) -> str | None:
    if not v.no_signal:
        return None
    numbers = ", ".join(f"{k}={v.now[k]:.3g}" for k in ("frac_zero_std_groups", "grad_norm") if k in v.now)
    return (f"no learning signal ({numbers}): the update changes nothing (every group's completions scored alike, "
            f"or a zero gradient)")


def _truncated(v: View) -> str | None:
    frac = v.now.get("frac_truncated", 0.0)
    if frac >= v.settings.truncated_fraction:
        return f"{frac:.0%} of the completions were cut at sampling.max_new_tokens"
    return None


def _empty_completions(v: View) -> str | None:
    frac = v.now.get("frac_empty", 0.0)
    return f"{frac:.0%} of the completions are empty" if frac >= v.settings.empty_fraction else None


def _reward_zero(v: View) -> str | None:
    if "reward/mean" not in v.now or "reward/std" not in v.now:
        return None
    zero = v.streak(lambda h: h.get("reward/mean") == 0.0 and h.get("reward/std") == 0.0)
    return f"every completion scored 0 for {zero} steps" if zero >= v.settings.reward_steps else None


def _reward_constant(v: View) -> str | None:
    m = v.now
    if "reward/mean" not in m or m.get("reward/std") != 0.0 or _reward_zero(v):
        return None
    value = m["reward/mean"]
    same = v.streak(lambda h: h.get("reward/std") == 0.0 and h.get("reward/mean") == value)
    return f"every completion scored {value:.4g} for {same} steps" if same >= v.settings.reward_steps else None


def _entropy_collapse(v: View) -> str | None:
    base, e, s = v.baseline("entropy"), v.now.get("entropy"), v.settings
    if v.warmed_up() and base and e is not None and v.no_gain() and e < s.entropy_ratio * base:
        return f"entropy {e:.3g} < {s.entropy_ratio:g} x its start {base:.3g} nats/token, reward no better"
    return None


def _kl_blowup(v: View) -> str | None:
    for key, what in (("kl", "KL to the reference"), ("drift_kl", "drift KL to the initial policy")):
        value = v.now.get(key)
        if value is not None and (not math.isfinite(value) or value > v.settings.kl_warn):
            return f"{what} {value:.3g} > {v.settings.kl_warn:g} nats/token"
    return None


def _length_collapse(v: View) -> str | None:
    base, length, low = v.baseline("completion_length/mean"), v.now.get("completion_length/mean"), v.settings.length_low
    if v.warmed_up() and base and length is not None and v.no_gain() and length < low * base:
        return f"mean completion length {length:.3g} < {low:g} x its start {base:.3g} tokens, reward no better"
    return None


def _length_explosion(v: View) -> str | None:
    base, length = v.baseline("completion_length/mean"), v.now.get("completion_length/mean")
    high = v.settings.length_high
    if v.warmed_up() and base and length is not None and length > high * base:
        return f"mean completion length {length:.3g} > {high:g} x its start {base:.3g} tokens"
    return None


def _repetition(v: View) -> str | None:
    frac = v.now.get("repetition/ngram_frac", 0.0)
    return f"{frac:.0%} of the completions' 3-grams are repeats" if frac >= v.settings.repetition else None


def _zero_variance_groups(v: View) -> str | None:
    if "frac_zero_std_groups" not in v.now:
        return None
    flat = v.streak(lambda h: h.get("frac_zero_std_groups", 0.0) >= v.settings.zero_std_groups)
    if flat >= max(v.settings.patience, 1):
        return (f"{v.now['frac_zero_std_groups']:.0%} of the groups had one score for all completions, {flat} steps "
                f"in a row")
    return None


def _throughput_drop(v: View) -> str | None:
    speeds, w = v.series("tokens_per_second", slice(v.settings.baseline_steps, None)), v.settings.throughput_window
    if len(speeds) < 2 * w:  # the first steps compile
        return None
    earlier, recent = float(np.median(speeds[:-w])), float(np.median(speeds[-w:]))
    if recent < v.settings.throughput_ratio * earlier:
        return f"median rollout throughput {recent:.4g} tokens/s over the last {w} steps, down from {earlier:.4g}"
    return None


CHECKS: tuple[Check, ...] = (
    Check("entropy_collapsed", "stop", _entropy_collapsed, needs_no_gain=True),
    Check("entropy_uniform", "stop", _entropy_uniform),
    Check("kl_exploded", "stop", _kl_exploded),
    Check("reward_stuck", "stop", _reward_stuck, needs_no_gain=True),
    Check("completions_empty", "stop", _completions_empty, needs_no_gain=True),
    Check("completions_truncated", "stop", _all_truncated, needs_no_gain=True),
    Check("skipped_updates", "stop", _skipped_updates),
    Check("no_learning_signal", "warn", _no_learning_signal,
          "read samples.jsonl, check the reward function, or raise sampling.temperature / rl.group_size"),
    Check("truncated", "warn", _truncated, "raise sampling.max_new_tokens if the answers need more tokens"),
    Check("empty_completions", "warn", _empty_completions,
          "the policy ends at once (EOS first); check the prompt format / chat template and sampling.max_new_tokens, "
          "or lower the learning rate"),
    Check("all_truncated", "warn", _all_truncated,
          "no completion reaches EOS; raise sampling.max_new_tokens, or check eos ids / the chat template, or add "
          "an overlong penalty"),
    Check("reward_zero", "warn", _reward_zero,
          "no completion ever scores; test the reward function on samples.jsonl, or start from a model that solves "
          "some prompts (SFT first)"),
    Check("reward_constant", "warn", _reward_constant,
          "every completion scores alike, so advantages are 0; check the reward function's range or raise "
          "sampling.temperature"),
    Check("entropy_collapse", "warn", _entropy_collapse,
          "the policy became near-deterministic without gaining reward; lower optim.learning_rate, raise rl.beta or "
          "rl.entropy_coef"),
    Check("kl_blowup", "warn", _kl_blowup,
          "the policy runs away from the reference/initial model; lower optim.learning_rate or raise rl.beta"),
    Check("length_collapse", "warn", _length_collapse,
          "completions shrink to nothing without gaining reward; check for a length-rewarding shortcut, lower "
          "optim.learning_rate"),
    Check("length_explosion", "warn", _length_explosion,
          "completions grow far past their start; check rl.loss.aggregation (token-mean favours long answers) and "
          "add an overlong penalty"),
    Check("repetition", "warn", _repetition,
          "completions repeat themselves (degenerate loops); lower optim.learning_rate, raise rl.beta, or add a "
          "repetition penalty reward"),
    Check("zero_variance_groups", "warn", _zero_variance_groups,
          "most groups score alike (task too easy or too hard): no learning signal; use harder/easier prompts, "
          "raise rl.group_size, or rl.dynamic_sampling"),
    Check("throughput_drop", "warn", _throughput_drop,
          "rollout tokens/s fell; another process shares the machine, the completions hit a larger compile "
          "bucket, or memory is swapping"),
)
HINTS = {c.name: c.hint for c in CHECKS if c.hint}
# Checks the shell handles itself: the skipped updates raise an error, the other two have their own cadence.
SHELL_CHECKS = ("skipped_updates", "no_learning_signal", "truncated")
DIVERGENCE_CHECKS = tuple(c for c in CHECKS if c.action == "stop" and c.name not in SHELL_CHECKS)
WARNING_CHECKS = tuple(c for c in CHECKS if c.action == "warn" and c.name not in SHELL_CHECKS)
CHECK = {c.name: c for c in CHECKS}


def diagnose(history: History, settings: MonitorSection | None = None) -> dict[str, str]:
    """The warning checks that hold at the last step of `history` (oldest first), each with its description
    (`settings`: the defaults when None). Pure: the same history gives the same answer."""
    settings = MonitorSection() if settings is None else settings
    if not settings.warnings or not history:
        return {}
    view = View(history, settings)
    return {c.name: found for c in WARNING_CHECKS if (found := c.condition(view))}


@dataclasses.dataclass(frozen=True)
class DivergenceState:
    """Consecutive steps each divergence check has counted, the baseline (first step) conditions and rewards;
    JSON in the checkpoint's metadata, so a resumed run keeps its streaks."""

    streaks: dict[str, int] = dataclasses.field(default_factory=dict)
    baseline: tuple[str, ...] | None = None
    last_reward: float | None = None
    baseline_reward: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"streaks": dict(self.streaks), "baseline": None if self.baseline is None else list(self.baseline),
                "last_reward": self.last_reward, "baseline_reward": self.baseline_reward}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> DivergenceState:
        if not data:
            return cls()
        baseline = data.get("baseline")
        return cls(dict(data.get("streaks", {})), None if baseline is None else tuple(baseline),
                   data.get("last_reward"), data.get("baseline_reward"))


def update_divergence(state: DivergenceState, metrics: dict[str, float], *, vocab_size: int,
                      settings: MonitorSection) -> tuple[DivergenceState, dict[str, str]]:
    """The new state after one step, and the divergence checks that now count (held `patience` steps in a row,
    and not at the baseline step) with their descriptions. `patience == 0` turns them off."""
    if settings.patience == 0:
        return state, {}

    def holding(last_reward: float | None) -> dict[str, str]:
        view = View([metrics], settings, vocab_size, last_reward)
        return {c.name: found for c in DIVERGENCE_CHECKS if (found := c.condition(view))}

    now, reward = holding(state.last_reward), metrics.get("reward/mean")
    if state.baseline is None:  # at the first step "stuck" means: no reward variance to start with
        baseline, baseline_reward = tuple(sorted(holding(reward))), reward
    else:
        baseline, baseline_reward = state.baseline, state.baseline_reward
    no_gain = reward is None or baseline_reward is None or reward <= baseline_reward
    counted = [n for n in now if n not in baseline and (no_gain or not CHECK[n].needs_no_gain)]
    streaks = {name: state.streaks.get(name, 0) + 1 for name in counted}
    diverged = {name: f"{now[name]} for {n} steps" for name, n in streaks.items() if n >= settings.patience}
    new = DivergenceState(streaks, baseline, None if reward is None else float(reward),
                          None if baseline_reward is None else float(baseline_reward))
    return new, diverged


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


def describe(name: str, detail: str) -> str:
    """The log line of a warning: its name, its numbers and the hint."""
    return f"diagnostic {name}: {detail}; hint: {HINTS[name]}"


@dataclasses.dataclass
class Verdict:
    """What the monitor found at one step: log lines, `diagnostics/*` metrics and, when updates keep being
    skipped, the reason the run must stop."""

    messages: list[str]
    metrics: dict[str, float]
    stop: str | None = None


class Monitor:
    """The shell's side of the checks: the history of the run's metrics, the divergence streaks (checkpointed
    through `divergence`), which warnings hold since when (`symptoms`, for summary.json) and the shell's own
    cadences (a no-signal run named every NO_SIGNAL_REPEAT steps, truncation once). Per step, `diverged` runs
    on the update's metrics (it decides whether this is the last step), `observe` after the evaluation."""

    def __init__(self, settings: MonitorSection, vocab_size: int) -> None:
        self.settings, self.vocab_size = settings, vocab_size
        self.divergence = DivergenceState()
        self.history: list[dict[str, float]] = []
        self.symptoms: dict[str, dict[str, int]] = {}  # name -> first_step, last_step, steps
        self.no_signal_in_a_row = 0
        self.warned_truncation = False

    def diverged(self, metrics: dict[str, float]) -> dict[str, str]:
        """The divergence checks that count at this step (see `update_divergence`)."""
        self.divergence, diverged = update_divergence(self.divergence, metrics, vocab_size=self.vocab_size,
                                                      settings=self.settings)
        return diverged

    def observe(self, step: int, metrics: dict[str, float], *, skipped: bool, no_signal: bool,
                max_new_tokens: int) -> Verdict:
        """The warnings of this step (its metrics with the evaluation's), and the skipped-updates stop."""
        s, messages = self.settings, []
        self.history.append({**{k: v for k, v in metrics.items() if not k.startswith("diagnostics/")},
                             "monitor/skipped": float(skipped)})
        view = View(self.history, s, self.vocab_size, no_signal=no_signal)
        self.no_signal_in_a_row = self.no_signal_in_a_row + 1 if no_signal else 0
        if self.no_signal_in_a_row % NO_SIGNAL_REPEAT == 1:
            messages.append(f"warning: step {step}: {_no_learning_signal(view)}; {HINTS['no_learning_signal']}")
        if not self.warned_truncation and (found := _truncated(view)):
            self.warned_truncation = True
            messages.append(f"warning: step {step}: {found}={max_new_tokens}; {HINTS['truncated']}")
        symptoms = diagnose(self.history, s)
        for name, detail in symptoms.items():
            seen = self.symptoms.get(name)
            if seen is None or seen["last_step"] != step - 1:
                messages.append(f"warning: step {step}: {describe(name, detail)}")
            if seen is None:
                seen = self.symptoms[name] = {"first_step": step, "last_step": step, "steps": 0}
            seen["last_step"], seen["steps"] = step, seen["steps"] + 1
        extra = ({"diagnostics/count": float(len(symptoms)), **{f"diagnostics/{n}": 1.0 for n in symptoms}}
                 if s.warnings else {})
        return Verdict(messages, extra, CHECK["skipped_updates"].condition(view))

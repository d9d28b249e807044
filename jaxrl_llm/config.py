"""Typed configuration of a whole run: dataclasses, YAML presets and dotted command-line overrides.

`load_run_config(yaml_path, overrides)` merges, in order, the dataclass defaults, the YAML file and
`section.field=value` overrides with OmegaConf (which type-checks every value and names the full key on
error), then `validate` checks the relations between numbers (which must divide which) up front, so a bad
config fails before anything is compiled.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import re
import sys
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from jaxrl_llm.errors import ConfigError, one_line

# Keys of earlier versions and what replaced them: a config that still uses one gets a one-line error.
RENAMED = {
    "grpo": "rl (the RL loop's section, for GRPO, RLOO, REINFORCE++ and PPO alike)",
    "rl.ratio_level": "rl.policy_loss (token -> ppo_clip, sequence -> gspo)",
}


@dataclass
class ModelSection:
    """The policy model: where it is, its dtypes and memory knobs."""

    path: str = ""  # required: a Hugging Face model directory or hub id (--algo sft with model.init: unused)
    dtype: str = "float32"  # compute dtype: float32 | bfloat16
    param_dtype: str = "float32"  # stored weights: float32 | bfloat16 (float32 master weights are kept)
    remat: bool = False  # recompute each layer's activations in the backward pass (less memory, more time)
    # layers per iteration of the training forward's layer loop; the layer count unrolls it completely (no
    # stacked residual buffers: a faster update on XLA:CPU, a longer compile); 1 = a loop over layers
    scan_unroll: int = 1
    # Memory of one float32 logits block [rows, chunk, V] when the train step and the reference pass compute
    # log-probs and entropy from the final hidden states (MiB); 0 = all completion positions in one block.
    logprob_block_mib: float = 256.0
    # Full-sequence attention takes at most this many queries at a time (float32 scores [B, H, chunk, S], not
    # [B, H, T, S]); 0 = all queries at once.
    attention_query_chunk: int = 128
    # --algo sft only: architecture of a model trained from scratch (HF config.json keys, with model_type),
    # and its tokenizer: a directory, or "arithmetic" for the default task's character tokenizer.
    init: dict[str, Any] = field(default_factory=dict)
    tokenizer: str = ""  # --algo sft with model.init: a tokenizer directory, or "arithmetic"


@dataclass
class DataSection:
    """Training and held-out data: files or hub datasets, which fields hold what, prompt rendering."""

    train: str = ""  # required: a JSONL path, or hf:NAME[:CONFIG] for a hub dataset
    eval: str = ""  # held-out prompts for greedy accuracy (JSONL or hf:NAME); "" = no evaluation
    split: str = "train"  # hub datasets only: the split of data.train
    eval_split: str = "test"  # hub datasets only: the split of data.eval
    prompt_field: str = "prompt"  # text, or a list of chat messages [{"role", "content"}]
    answer_field: str = "answer"  # passed to reward functions as a keyword (all fields are)
    chosen_field: str = "chosen"  # --algo rm: the preferred response of a pair
    rejected_field: str = "rejected"  # --algo rm: the other response
    # Optional templates applied to each record: "{question}" style, filled from the record's fields.
    prompt_template: str = ""  # e.g. "Question: {question}"; "" = the prompt field as it is
    answer_template: str = ""  # e.g. "{solution}"; "" = the answer field as it is
    chat_template: bool = False  # render the prompt with the tokenizer's chat template
    system_prompt: str = ""  # prepended as a system message (chat) or as text
    max_prompt_tokens: int = 512  # longer prompts are dropped (with a count), never cut
    shuffle: bool = True  # reshuffle the training records every epoch (seeded)


@dataclass
class SamplingSection:
    """How rollouts are sampled (the held-out evaluation decodes greedily with the same length limit)."""

    max_new_tokens: int = 256  # completion length limit; a longer completion is cut (counted in frac_truncated)
    temperature: float = 1.0  # rollout sampling temperature (evaluation is greedy)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # nucleus sampling; 1 = off
    min_p: float = 0.0  # drop tokens below min_p * the top probability; 0 = off
    # Compile buckets: prompt widths and completion lengths are rounded up to these multiples, so calls with
    # lengths in one bucket reuse one compiled sampler / train step. Smaller = less padding, more compiles.
    prompt_bucket: int = 16
    new_tokens_bucket: int = 16  # completion lengths are rounded up to a multiple of this


# rl.rollout_correction: where the old policy's log-probs come from (see RLSection)
ROLLOUT_CORRECTIONS = ("none", "recompute", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass
class RLSection:
    """The RL loop (GRPO family and PPO): rollout sizes, the update's epochs and minibatches, the policy loss
    and the advantage estimator (both picked by name from their registries)."""

    prompts_per_step: int = 16  # P
    group_size: int = 8  # G: samples per prompt
    mu: int = 1  # optimisation passes over each rollout
    minibatch_size: int = 0  # sequences per optimizer step; 0 = the whole rollout (P * G)
    grad_accum: int = 1  # micro-batches per optimizer step (divides minibatch_size)
    epsilon_low: float = 0.2  # ratio clip range below 1 (PPO epsilon)
    epsilon_high: float = 0.2  # ratio clip range above 1 (DAPO clip-higher: 0.28)
    dual_clip_c: float = 0.0  # 0 = off; else > 1
    # rl.losses.POLICY_LOSSES: ppo_clip (token ratio) | gspo (sequence ratio) | cispo (clipped IS weight, MiniMax-M1)
    # | sapo (soft gate, SAPO) | module:function
    policy_loss: str = "ppo_clip"
    sapo_tau_pos: float = 1.0  # sapo: gate temperature of tokens with advantage > 0 (TRL sapo_temperature_pos)
    sapo_tau_neg: float = 1.05  # sapo: gate temperature of tokens with advantage <= 0 (TRL sapo_temperature_neg)
    beta: float = 0.0  # KL coefficient to the reference model; 0 skips the reference pass
    kl_estimator: str = "k3"  # k1 | k2 | k3 (Schulman's estimators of the KL term)
    loss_aggregation: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum(-norm)
    scale_rewards: str = "group"  # group | batch (group mean, std of the whole batch) | none (Dr.GRPO)
    entropy_coef: float = 0.0  # adds -entropy_coef * entropy to the loss (the start value when adaptive)
    # > 0: adaptive entropy control (Skywork-OR1, GRPO family): entropy_coef moves by entropy_coef_delta per step,
    # up while the mean entropy per token is below this target (nats) and down above it, and the bonus is applied
    # only below it; 0 = entropy_coef stays fixed
    entropy_target: float = 0.0
    entropy_coef_delta: float = 0.005  # adaptive entropy control: change of entropy_coef per step
    entropy_coef_min: float = 0.0  # adaptive entropy control: entropy_coef's lower bound
    entropy_coef_max: float = 1.0  # adaptive entropy control: entropy_coef's upper bound
    # < 1: the policy gradient only on this fraction of each batch's valid tokens, those of highest entropy
    # ("Beyond the 80/20 rule": 0.2); 1 = every token
    top_entropy_quantile: float = 1.0
    # > 0: Clip-Cov (Cui et al. 2025): detach the gradient of this fraction of the tokens (at least 1), those of
    # highest covariance of log-prob and advantage within (clip_cov_lb, clip_cov_ub); 0 = off (verl: 0.0002)
    clip_cov_ratio: float = 0.0
    clip_cov_lb: float = 1.0  # Clip-Cov: lower bound of the covariance of the tokens it may detach
    clip_cov_ub: float = 5.0  # Clip-Cov: upper bound of the covariance of the tokens it may detach
    # > 0: KL-Cov (Cui et al. 2025): add kl_cov_coef * |log pi - log pi_old| to the loss of this fraction of the
    # tokens (at least 1), those of highest covariance of log-prob and advantage; 0 = off (verl: 0.0002)
    kl_cov_ratio: float = 0.0
    kl_cov_coef: float = 1.0  # KL-Cov: the penalty's coefficient (the paper's recipes; verl ppo_kl_coef, 0.1 there)
    # The old policy's log-probs and the sampler / trainer mismatch (GRPO family and PPO):
    # none = the sampler's log-probs are the old policy's (no extra pass);
    # recompute = the trainer's forward recomputes them before the update (verl's default);
    # token_truncate | token_mask | sequence_truncate | sequence_mask = recompute, and weight the policy-gradient
    # term by the importance ratio pi_old / pi_sampler per token or per sequence, truncated at
    # rollout_correction_cap or masked (0) above it (TRL's vllm_importance_sampling_mode, verl's rollout_is)
    rollout_correction: str = "none"
    rollout_correction_cap: float = 3.0  # C of the *_truncate / *_mask modes (TRL's default)
    # Advantage estimator: "" = the algorithm's own (grpo, rloo, reinforce_pp); or reinforce_pp_baseline.
    estimator: str = ""
    dynamic_sampling: bool = False  # DAPO: drop zero-variance groups and refill the batch
    max_refill_rounds: int = 3  # DAPO: extra sampling rounds per step at most


@dataclass
class PPOSection:
    """--algo ppo only; the loop's knobs (prompts_per_step, group_size, mu, minibatch_size, epsilons,
    entropy_coef) are in `rl`. The KL to the reference is in the per-token reward, not in the loss."""

    gamma: float = 1.0  # discount over completion tokens
    lam: float = 0.95  # GAE lambda
    value_clip: float = 0.2  # clip range of V around the rollout's values; 0 = no value clipping
    critic_learning_rate: float = 5.0e-4  # the critic's own AdamW (same schedule / warmup as optim)
    critic_warmup_steps: int = 0  # first steps train only the critic (the policy is not updated)
    critic_init: str = "policy"  # "policy" (a copy of its decoder) or a model directory (e.g. a reward model)
    kl_coef_init: float = 0.01  # beta of r_t = -beta * KL_t + [t = last] * score
    kl_estimator: str = "k1"  # the per-token KL in the reward: k1 | k2 | k3
    kl_target: float = 0.0  # adaptive controller target (mean KL per token); 0 = fixed coefficient
    kl_horizon: float = 10000.0  # adaptive controller horizon, in samples
    whiten_advantages: bool = True  # normalise GAE advantages over the batch


@dataclass
class DPOSection:
    """--algo dpo: preference optimisation on (prompt, chosen, rejected) pairs, against a frozen reference."""

    loss: str = "sigmoid"  # sigmoid (DPO) | ipo | hinge (SLiC) | simpo (reference-free, length-normalised)
    beta: float = 0.1  # the implicit reward is beta * (log pi - log pi_ref) of a response (simpo: of its mean)
    label_smoothing: float = 0.0  # sigmoid / simpo: the share of flipped labels assumed (conservative DPO)
    simpo_gamma: float = 0.5  # simpo: the target reward margin
    # Reference log-probs: "step" = a frozen copy's, computed inside each jitted step; "precompute" = once for
    # the whole dataset before training (no reference weights kept during the updates).
    reference: str = "step"
    eval_prompts: str = ""  # prompts with answers (JSONL / hf:NAME) for greedy task accuracy; "" = none


@dataclass
class LoraSection:
    """LoRA adapters (jaxrl_llm.models.lora) for the GRPO family, PPO's policy, SFT and DPO: the base weights are frozen
    (no gradients, no optimizer state) and double as the reference model (adapters off)."""

    rank: int = 0  # r; 0 = no LoRA (full fine-tuning)
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapters' input in the update (PEFT's lora_dropout); off when sampling
    # Regular expression searched in each layer kernel's HF module name (model.layers.0.self_attn.q_proj, ...).
    targets: str = "(q|k|v|o|gate|up|down)_proj"
    export_adapters: bool = False  # also write the adapters in PEFT format (out_dir/hf/adapter) at export


@dataclass
class RewardSpec:
    """One reward function of the weighted sum."""

    name: str = ""  # a built-in (math_answer, math_verify, format, overlong, reward_model) or "module:function"
    weight: float = 1.0  # the step's reward is the weighted sum of the functions
    kwargs: dict[str, Any] = field(default_factory=dict)  # keywords bound to the function (e.g. {path: DIR})
    # seconds a call may take, else the run stops with an error naming the function (0 = no limit); a call
    # still running after 10 s prints a notice on stderr, so a stall is never silent
    timeout_s: float = 300.0


@dataclass
class OptimSection:
    """AdamW (optax) with warmup, a schedule and gradient clipping."""

    learning_rate: float = 1e-5  # AdamW peak learning rate
    warmup_steps: int = 0  # linear warmup from 0
    schedule: str = "constant"  # constant | cosine | linear (decay to end_lr_ratio * lr after warmup)
    end_lr_ratio: float = 0.0  # cosine / linear: the final learning rate as a fraction of the peak
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.99  # AdamW second-moment decay
    max_grad_norm: float = 1.0  # global-norm gradient clipping; 0 = off


@dataclass
class SFTSection:
    """Batch sizes of the supervised algorithms (--algo sft, rm and dpo)."""

    batch_size: int = 64  # --algo sft / rm / dpo: examples (pairs) per optimizer step
    eval_batch_size: int = 256  # --algo sft / rm / dpo: examples (pairs) per evaluation batch


@dataclass
class MeshSection:
    """Device mesh (see `jaxrl_llm.sharding`): data * fsdp * tensor = all devices; one axis may be -1."""

    data: int = -1  # data parallel: params replicated, batch split
    fsdp: int = 1  # batch split, params and optimizer state sharded
    tensor: int = 1  # attention heads and MLP columns split


@dataclass
class DistributedSection:
    """Multi-host: `jax.distributed.initialize` before anything touches the devices. Empty fields are taken
    from the environment (JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, or what JAX detects
    on SLURM, Open MPI and TPU pods); `enabled=false` and no such variables: one process."""

    enabled: bool = False  # call jax.distributed.initialize (several processes)
    coordinator_address: str = ""  # host:port of process 0
    num_processes: int = 0  # 0 = from the environment
    process_id: int = -1  # -1 = from the environment
    local_device_ids: list[int] = field(default_factory=list)  # default: all local devices


@dataclass
class DivergenceSection:
    """Collapse checks on each RL step's metrics (`jaxrl_llm.run.divergence`); a condition that holds for
    `patience` steps in a row is a divergence, handled by the run's `on_divergence`."""

    patience: int = 5  # consecutive steps a condition must hold (0 = checks off)
    entropy_floor: float = 0.01  # nats/token: below it the policy is deterministic (collapsed to one answer)
    entropy_ceiling: float = 0.95  # fraction of log V: above it the policy is ~uniform noise
    kl_max: float = 10.0  # mean KL to the reference per token (nats); above it the policy ran away
    reward_stuck: bool = True  # every completion of the step scored the same, and the same as the last step


@dataclass
class DiagnosticsSection:
    """Named symptoms of an RL run (`jaxrl_llm.run.diagnostics`): each is logged with a hint when it starts and as
    the metric `diagnostics/<name>` while it holds; warnings only (a run is stopped by `divergence`)."""

    enabled: bool = True  # check the symptoms every step
    baseline_steps: int = 3  # the first N steps are the baseline of the entropy and length ratios
    patience: int = 5  # steps zero-variance groups must persist
    empty_fraction: float = 0.5  # share of empty completions that names empty_completions
    reward_steps: int = 10  # steps of one reward for all completions that name reward_zero / reward_constant
    entropy_ratio: float = 0.1  # entropy below this share of its baseline (reward no better): entropy_collapse
    kl_max: float = 1.0  # kl or drift_kl per token (nats) above it: kl_blowup
    length_low: float = 0.25  # mean length below this share of its baseline (reward no better): length_collapse
    length_high: float = 4.0  # mean length above this multiple of its baseline: length_explosion
    repetition: float = 0.5  # share of repeated 3-grams in the completions that names repetition
    zero_std_groups: float = 0.95  # frac_zero_std_groups at or above it for `patience` steps: zero_variance_groups
    # throughput_drop: the median tokens/s of the last `throughput_window` steps below this x the median before
    throughput_ratio: float = 0.5
    throughput_window: int = 10  # steps of the recent median that throughput_ratio compares
    # KL(pi || pi_initial) per token on this many rollout rows at each evaluation step, logged as drift_kl even
    # when rl.beta = 0 (a copy of the initial weights is kept on the host); 0 = off
    drift_rows: int = 64


@dataclass
class LoggingSection:
    """Where metrics go besides metrics.jsonl and TensorBoard."""

    wandb: bool = False  # also send every metrics row to Weights & Biases (pip install wandb)
    wandb_project: str = "jaxrl_llm"  # the W&B project
    wandb_mode: str = "offline"  # offline (no network; `wandb sync` later) | online


@dataclass
class RunConfig:
    """A whole run."""

    algo: str = "grpo"  # grpo | rloo | reinforce_pp | ppo | sft | rm | dpo (train.py --algo)
    seed: int = 0  # the run's root random key (sampling, data order, dropout-free init)
    steps: int = 100  # training steps (one rollout + update each, for the RL algorithms)
    out_dir: str = "runs/default"  # metrics, samples, checkpoints and the export go here
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    sampling: SamplingSection = field(default_factory=SamplingSection)
    rl: RLSection = field(default_factory=RLSection)
    sft: SFTSection = field(default_factory=SFTSection)
    ppo: PPOSection = field(default_factory=PPOSection)
    dpo: DPOSection = field(default_factory=DPOSection)
    lora: LoraSection = field(default_factory=LoraSection)
    rewards: list[RewardSpec] = field(default_factory=list)  # required for RL: [{name: ..., weight: ...}, ...]
    optim: OptimSection = field(default_factory=OptimSection)
    mesh: MeshSection = field(default_factory=MeshSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)
    divergence: DivergenceSection = field(default_factory=DivergenceSection)
    diagnostics: DiagnosticsSection = field(default_factory=DiagnosticsSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    on_divergence: str = "stop"  # stop: end the run, keep the last good checkpoint, no export | warn: log only
    log_every: int = 1  # a metrics row (and a plain log line when not on a terminal) every N steps
    sample_every: int = 10  # write sample completions with rewards at step 1 and every N steps (0 = never)
    # Held-out accuracy = share of greedy answers this reward scores exactly 1: a built-in name or
    # module:function; "" = the first of `rewards` (set it when that one is not a 0/1 check, e.g. a reward model).
    eval_reward: str = ""
    eval_every: int = 0  # held-out greedy evaluation every N steps (0: only before and after)
    eval_size: int = 256  # held-out prompts per evaluation (0: all)
    eval_batch_size: int = 256  # prompts per greedy evaluation batch
    checkpoint_every: int = 50  # orbax checkpoint every N steps, and at the end (0 = never)
    keep_checkpoints: int = 2  # the newest K checkpoints are kept
    # full: the final checkpoint holds the optimizer state too (an exact --resume); weights: only the policy
    # weights are kept at the end of a finished run (earlier checkpoints and optimizer moments deleted).
    final_checkpoint: str = "full"
    export: bool = True  # write the final policy as a Hugging Face directory
    export_dir: str = ""  # default: out_dir/hf
    tensorboard: bool = True  # TensorBoard events under out_dir/tensorboard
    progress_bar: bool = True  # a tqdm bar on a terminal; plain log lines otherwise
    report: bool = True  # train.py writes out_dir/report/report.html (python -m jaxrl_llm.report) at the end


def load_run_config(path: str | Path | None, overrides: list[str] | None = None, **fields: Any) -> RunConfig:
    """Defaults < YAML file < `fields` < dotted `overrides` ("rl.beta=0.04"), type-checked, validated.

    Every error is a one-line `ConfigError` that names the key and where its value came from: the YAML file,
    the Python API's `fields` or the command line."""
    overrides = list(overrides or [])
    add_import_path(Path.cwd())  # `python train.py` puts the script's folder on sys.path, not the current one
    merged = OmegaConf.structured(RunConfig)
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"config file {path} does not exist (--config takes a YAML preset, e.g. configs/)")
        try:
            _check_top_level(path)
            loaded = OmegaConf.load(path)
        except ConfigError:
            raise
        except Exception as e:  # YAML syntax: the parser's message has the line and column
            raise ConfigError(f"{path} is not valid YAML: {one_line(str(e))}") from e
        _check_renamed(OmegaConf.to_container(loaded), f"in {path}")
        if isinstance(loaded, DictConfig):
            loaded = OmegaConf.create(resolve_yaml_paths(OmegaConf.to_container(loaded), Path(path).parent))
        add_import_path(Path(path).parent)  # reward / estimator modules beside the YAML file
        _check_containers(OmegaConf.to_container(loaded), RunConfig, "", f"in {path}")
        try:
            merged = OmegaConf.merge(merged, loaded)
        except OmegaConfBaseException as e:
            raise ConfigError(_omegaconf_message(e, f"in {path}")) from e
        except Exception as e:  # YAML syntax: the parser's message has the line and column
            raise ConfigError(f"{path} is not valid YAML: {one_line(str(e))}") from e
    if fields:  # the Python API's mapping: its type and key errors are config errors too, never omegaconf's
        _check_renamed(fields, API_WHERE)
        _check_containers(fields, RunConfig, "", API_WHERE)
        try:
            merged = OmegaConf.merge(merged, OmegaConf.create(fields))
        except OmegaConfBaseException as e:
            raise ConfigError(_omegaconf_message(e, API_WHERE)) from e
        except TypeError as e:  # a container OmegaConf cannot merge that _check_containers did not foresee
            raise ConfigError(f"invalid configuration {API_WHERE}: {one_line(str(e))}") from e
    for item in overrides:
        key, eq, _ = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"command-line override {item!r} must be key=value, e.g. rl.beta=0.04 or steps=10")
        _check_renamed(key.strip(), f"on the command line ({item!r})")
        if not _.strip():  # `data.eval=` means the empty string (YAML would read null)
            item = f"{key}=''"
        where = f"on the command line ({item!r})"
        try:
            dotted = OmegaConf.from_dotlist([item])
            _check_containers(OmegaConf.to_container(dotted), RunConfig, "", where)
            merged = OmegaConf.merge(merged, dotted)
        except OmegaConfBaseException as e:
            raise ConfigError(_omegaconf_message(e, where)) from e
        except TypeError as e:  # as for the Python API's fields
            raise ConfigError(f"invalid configuration {where}: {one_line(str(e))}") from e
        except yaml.YAMLError as e:  # the value is parsed as YAML: `rewards=[` has no closing bracket
            raise ConfigError(f"command-line override {item!r}: the value is not valid YAML: {one_line(str(e))}") from e
    try:
        config: RunConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as e:
        raise ConfigError(_omegaconf_message(e, API_WHERE if fields else f"in {path}" if path else "")) from e
    try:
        validate(config)
    except ConfigError as e:
        raise ConfigError(f"{e} ({config_source(str(e), path, overrides, fields)})") from e
    return config


API_WHERE = "in the Python API's config"  # where `load_run_config`'s keyword fields (jaxrl_llm.train) come from


def _describe(value: Any) -> str:
    """`value` as an error message shows it: its type and a short repr."""
    kinds = {Mapping: "a mapping", list: "a list", tuple: "a list", str: "a string", bool: "a boolean",
             int: "a number", float: "a number"}  # bool before int: True is an int too
    name = next((v for t, v in kinds.items() if isinstance(value, t)), f"a value of type {type(value).__name__}")
    return f"{name} ({one_line(repr(value))[:40]})"


def _check_containers(tree: Any, cls: type, prefix: str, where: str) -> None:
    """`ConfigError` naming the key where `tree` (a YAML file's or the Python API's mapping) has a list for a
    section or mapping, a mapping for a list, or a single value for either: OmegaConf's merge reports those
    without the key ("Cannot merge incompatible container types", a bare TypeError)."""
    if not isinstance(tree, Mapping):
        return
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in tree or tree[f.name] is None:  # None: OmegaConf's own "is not Optional" names the key
            continue
        value, key, kind = tree[f.name], f"{prefix}{f.name}", hints[f.name]
        origin = typing.get_origin(kind)
        if dataclasses.is_dataclass(kind) or origin is dict:
            if not isinstance(value, Mapping):
                what = "the section's fields" if dataclasses.is_dataclass(kind) else "keys to values"
                raise ConfigError(f"config key {key} {where}: expected a mapping of {what}, got {_describe(value)}")
            if dataclasses.is_dataclass(kind):
                _check_containers(value, kind, f"{key}.", where)
        elif origin is list:
            if not isinstance(value, (list, tuple)):
                raise ConfigError(f"config key {key} {where}: expected a list, got {_describe(value)}")
            item = typing.get_args(kind)[0]
            if dataclasses.is_dataclass(item):
                for i, entry in enumerate(value):
                    if not isinstance(entry, Mapping):
                        raise ConfigError(f"config key {key}[{i}] {where}: expected a mapping such as "
                                          f"{{name: math_answer}}, got {_describe(entry)}")
                    _check_containers(entry, item, f"{key}[{i}].", where)


def _check_top_level(path: str | Path) -> None:
    """`ConfigError` unless the YAML document at `path` is a mapping (or empty): OmegaConf's own errors for a
    list or a single value ("Cannot merge incompatible container types") do not say what is wrong."""
    with open(path, encoding="utf-8") as f:
        root = yaml.compose(f, Loader=yaml.SafeLoader)  # the node tree only: a syntax error keeps its line/column
    if root is None or isinstance(root, yaml.MappingNode) or root.tag == "tag:yaml.org,2002:null":
        return  # an empty file (or only comments, or `null`) is the defaults, as before
    if isinstance(root, yaml.SequenceNode):
        kind = "a list"
    else:
        names = {"int": "a number", "float": "a number", "bool": "a boolean", "str": "a string"}
        kind = f"{names.get(root.tag.rsplit(':', 1)[-1], 'a single value')} ({one_line(str(root.value))[:40]!r})"
    raise ConfigError(f"{path}: the top level must be a mapping of config sections (model:, data:, rl:, ...), "
                      f"not {kind}")


# Fields holding paths: relative values in a YAML file are relative to the file's folder, on the command line to
# the current folder. The ones that may also be a hub id keep a value that only looks like one ("org/name").
PATH_FIELDS = ("out_dir", "export_dir", "model.path", "model.tokenizer", "data.train", "data.eval",
               "ppo.critic_init", "dpo.eval_prompts")
HUB_ID_FIELDS = ("model.path", "model.tokenizer", "ppo.critic_init", "rewards[].kwargs.path")
NOT_A_PATH = {"model.tokenizer": "arithmetic", "ppo.critic_init": "policy"}


def looks_local(value: str) -> bool:
    """A path no hub id can be: absolute, ./ ../ ~, or more than one `/` (hub ids are NAME or ORG/NAME)."""
    return value.startswith((".", "/", "~")) or value.count("/") > 1 or "\\" in value


def shown_path(path: Path) -> str:
    """An absolute path as a run shows it: relative to the current folder when inside it, else absolute."""
    path = Path(os.path.normpath(path.expanduser().absolute()))
    try:
        return str(path.relative_to(Path.cwd())) or "."
    except ValueError:
        return str(path)


def resolve_path(key: str, value: Any, base: Path) -> Any:
    """`value` of the path field `key`, read from a YAML file in `base`, made relative to the current folder."""
    if not isinstance(value, str) or not value or value.startswith("hf:") or NOT_A_PATH.get(key) == value:
        return value
    if Path(value).expanduser().is_absolute():
        return value
    if key in HUB_ID_FIELDS and not looks_local(value) and not (base / value).exists():
        return value  # a hub id (a missing local directory is reported when the run checks its inputs)
    return shown_path(base / value)


def resolve_yaml_paths(tree: Any, base: Path) -> Any:
    """The YAML mapping `tree` with its path fields (`PATH_FIELDS`, rewards' `kwargs.path`) resolved against `base`."""
    if not isinstance(tree, dict):
        return tree
    tree = {k: (dict(v) if isinstance(v, dict) else v) for k, v in tree.items()}
    for key in PATH_FIELDS:
        section, _, name = key.rpartition(".")
        node = tree.get(section) if section else tree
        if isinstance(node, dict) and name in node:
            node[name] = resolve_path(key, node[name], base)
    if isinstance(tree.get("rewards"), list):
        tree["rewards"] = [
            {**r, "kwargs": {**r["kwargs"], "path": resolve_path("rewards[].kwargs.path", r["kwargs"]["path"], base)}}
            if isinstance(r, dict) and isinstance(r.get("kwargs"), dict) and "path" in r["kwargs"] else r
            for r in tree["rewards"]
        ]
    return tree


def add_import_path(folder: Path) -> None:
    """Let `module:function` names import modules from `folder` (appended: installed packages win)."""
    entry = str(folder.expanduser().absolute())
    if entry not in sys.path:
        sys.path.append(entry)


def _check_renamed(tree: Any, where: str) -> None:
    """`ConfigError` naming the new key when `tree` (a YAML mapping, or one dotted key) uses a renamed one."""
    if isinstance(tree, str):
        keys = [tree]
    else:
        tree = tree if isinstance(tree, dict) else {}
        keys = [str(k) for k in tree] + [f"{k}.{sub}" for k, v in tree.items() if isinstance(v, dict) for sub in v]
    for key in keys:
        for old, new in RENAMED.items():
            if key == old or key.startswith(old + "."):
                raise ConfigError(f"config key {key} {where} was renamed to {new}")


def _omegaconf_message(e: OmegaConfBaseException, where: str) -> str:
    key = getattr(e, "full_key", None)
    msg = (str(getattr(e, "msg", None) or e).strip().splitlines() or [type(e).__name__])[0]
    where = f" {where}" if where else ""
    return f"config key {key}{where}: {msg}".replace("  ", " ") if key else f"invalid configuration{where}: {msg}"


def _has_key(tree: Any, key: str) -> bool:
    """Whether the nested mapping `tree` sets the dotted `key` (list items by index: rewards.0.weight)."""
    for part in key.split("."):
        if isinstance(tree, (list, tuple)) and part.isdigit() and int(part) < len(tree):
            tree = tree[int(part)]
        elif isinstance(tree, Mapping) and part in tree:
            tree = tree[part]
        else:
            return False
    return True


def config_source(message: str, path: str | Path | None, overrides: list[str],
                  fields: dict[str, Any] | None = None) -> str:
    """Where the `key=value` settings a message names were set: the command line, the Python API's mapping
    (`fields`), the YAML file or defaults."""
    keys = [k for k in re.findall(r"([a-z_][a-z0-9_.]*)=", message) if "." in k or hasattr(RunConfig, k)]
    given = {o.split("=", 1)[0].strip() for o in overrides}
    if any(k in given for k in keys):
        return "set on the command line"
    if keys and path is not None:
        tree: Any = OmegaConf.to_container(OmegaConf.load(path))
        for key in keys:
            node = tree
            for part in key.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            if node is not None:
                return f"set in {path}"
    # After the YAML file: train.py passes --algo as a field, and a message naming `algo` names a key set
    # in the file or on the command line too.
    if fields and any(_has_key(fields, k) for k in keys):
        return f"set {API_WHERE}"
    if keys:
        return "the default"
    return f"from {path}" if path is not None else API_WHERE if fields else "from the defaults"


def _choice(value: str, name: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r}: expected one of {', '.join(choices)}")


# Bounds of every numeric field, checked before anything loads: (key, low, high, low_inclusive).
_AT_LEAST = 0.0, float("inf"), True
_POSITIVE = 0.0, float("inf"), False
_AT_LEAST_1 = 1.0, float("inf"), True
_FRACTION = 0.0, 1.0, True
NUMERIC_BOUNDS: dict[str, tuple[float, float, bool]] = {
    "seed": _AT_LEAST, "steps": _AT_LEAST, "log_every": _AT_LEAST_1, "sample_every": _AT_LEAST,
    "eval_every": _AT_LEAST, "eval_size": _AT_LEAST, "eval_batch_size": _AT_LEAST_1,
    "checkpoint_every": _AT_LEAST, "keep_checkpoints": _AT_LEAST_1,
    "model.logprob_block_mib": _AT_LEAST, "model.attention_query_chunk": _AT_LEAST,
    "data.max_prompt_tokens": _AT_LEAST_1, "model.scan_unroll": _AT_LEAST_1,
    "sampling.max_new_tokens": _AT_LEAST_1, "sampling.temperature": _POSITIVE, "sampling.top_k": _AT_LEAST,
    "sampling.top_p": (0.0, 1.0, False), "sampling.min_p": _FRACTION, "sampling.prompt_bucket": _AT_LEAST_1,
    "sampling.new_tokens_bucket": _AT_LEAST_1,
    "rl.prompts_per_step": _AT_LEAST_1, "rl.group_size": _AT_LEAST_1, "rl.mu": _AT_LEAST_1,
    "rl.minibatch_size": _AT_LEAST, "rl.grad_accum": _AT_LEAST_1, "rl.epsilon_low": _AT_LEAST,
    "rl.epsilon_high": _AT_LEAST, "rl.dual_clip_c": _AT_LEAST, "rl.beta": _AT_LEAST,
    "rl.entropy_coef": (-float("inf"), float("inf"), True), "rl.max_refill_rounds": _AT_LEAST,
    "rl.sapo_tau_pos": _POSITIVE, "rl.sapo_tau_neg": _POSITIVE, "rl.entropy_target": _AT_LEAST,
    "rl.entropy_coef_delta": _AT_LEAST, "rl.entropy_coef_min": _AT_LEAST, "rl.entropy_coef_max": _AT_LEAST,
    "rl.top_entropy_quantile": (0.0, 1.0, False), "rl.clip_cov_ratio": _FRACTION,
    "rl.clip_cov_lb": (-float("inf"), float("inf"), True), "rl.clip_cov_ub": (-float("inf"), float("inf"), True),
    "rl.kl_cov_ratio": _FRACTION, "rl.kl_cov_coef": _AT_LEAST, "rl.rollout_correction_cap": _POSITIVE,
    "optim.learning_rate": _POSITIVE, "optim.warmup_steps": _AT_LEAST, "optim.end_lr_ratio": _FRACTION,
    "optim.weight_decay": _AT_LEAST, "optim.beta1": (0.0, 1.0, True), "optim.beta2": (0.0, 1.0, True),
    "optim.max_grad_norm": _AT_LEAST,
    "sft.batch_size": _AT_LEAST_1, "sft.eval_batch_size": _AT_LEAST_1,
    "lora.rank": _AT_LEAST, "lora.alpha": _POSITIVE, "lora.dropout": _FRACTION,
    "dpo.beta": _POSITIVE, "dpo.label_smoothing": (0.0, 0.5, True), "dpo.simpo_gamma": _AT_LEAST,
    "divergence.patience": _AT_LEAST, "divergence.entropy_floor": _AT_LEAST,
    "divergence.entropy_ceiling": (0.0, 1.0, False), "divergence.kl_max": _POSITIVE,
    "diagnostics.baseline_steps": _AT_LEAST_1, "diagnostics.patience": _AT_LEAST_1,
    "diagnostics.empty_fraction": _FRACTION, "diagnostics.reward_steps": _AT_LEAST_1,
    "diagnostics.entropy_ratio": _AT_LEAST, "diagnostics.kl_max": _POSITIVE, "diagnostics.length_low": _AT_LEAST,
    "diagnostics.length_high": _POSITIVE, "diagnostics.repetition": _FRACTION,
    "diagnostics.zero_std_groups": _FRACTION, "diagnostics.throughput_ratio": _AT_LEAST,
    "diagnostics.throughput_window": _AT_LEAST_1,
    "diagnostics.drift_rows": _AT_LEAST,
}
_EXCLUSIVE_HIGH = {"optim.beta1", "optim.beta2", "lora.dropout"}  # Adam's moment decay must stay below 1


def _get(c: Any, key: str) -> Any:
    for part in key.split("."):
        c = getattr(c, part)
    return c


def _check_number(key: str, value: float, bounds: tuple[float, float, bool]) -> None:
    low, high, low_inclusive = bounds
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value} must be a finite number")
    too_low = value < low if low_inclusive else value <= low
    too_high = value >= high if key in _EXCLUSIVE_HIGH else value > high
    if too_low or too_high:
        lo = f"{'>=' if low_inclusive else '>'} {low:g}"
        hi = "" if high == float("inf") else f" and {'<' if key in _EXCLUSIVE_HIGH else '<='} {high:g}"
        raise ConfigError(f"{key}={value} must be {lo}{hi}")


def validate(c: RunConfig) -> None:
    """Check every numeric field's range and the relations between fields, naming each number involved."""
    for key, bounds in NUMERIC_BOUNDS.items():
        _check_number(key, _get(c, key), bounds)
    if c.algo == "ppo":
        _validate_ppo(c.ppo)
    _choice(c.dpo.loss, "dpo.loss", ("sigmoid", "ipo", "hinge", "simpo"))
    if c.lora.rank:
        if c.algo == "rm" or (c.algo == "sft" and c.model.init):
            raise ConfigError(f"lora.rank={c.lora.rank} with algo={c.algo}: LoRA adapts a pretrained policy "
                              f"(GRPO family, PPO, DPO, SFT from model.path); set lora.rank=0")
        try:
            re.compile(c.lora.targets)
        except re.error as e:
            raise ConfigError(f"lora.targets={c.lora.targets!r} is not a regular expression: {e}") from e
    _choice(c.dpo.reference, "dpo.reference", ("step", "precompute"))
    from jaxrl_llm.trainers import ALGORITHMS

    _choice(c.algo, "algo", tuple(ALGORITHMS))
    _choice(c.on_divergence, "on_divergence", ("stop", "warn"))
    _choice(c.logging.wandb_mode, "logging.wandb_mode", ("offline", "online"))
    _choice(c.final_checkpoint, "final_checkpoint", ("full", "weights"))
    _choice(c.model.dtype, "model.dtype", ("float32", "bfloat16"))
    _choice(c.model.param_dtype, "model.param_dtype", ("float32", "bfloat16"))
    g = c.rl
    _choice(g.kl_estimator, "rl.kl_estimator", ("k1", "k2", "k3"))
    resolve_policy_loss(g.policy_loss)
    _choice(
        g.loss_aggregation,
        "rl.loss_aggregation",
        ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"),
    )
    _choice(g.scale_rewards, "rl.scale_rewards", ("group", "batch", "none"))
    _choice(g.rollout_correction, "rl.rollout_correction", ROLLOUT_CORRECTIONS)
    _choice(c.optim.schedule, "optim.schedule", ("constant", "cosine", "linear"))
    sizes = (c.mesh.data, c.mesh.fsdp, c.mesh.tensor)
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ConfigError(f"mesh.data/fsdp/tensor={sizes}: each is a positive size, and at most one is -1")
    if g.estimator:
        from jaxrl_llm.rl.estimators import needs_values

        if needs_values(resolve_estimator(g.estimator)) != (c.algo == "ppo"):
            raise ConfigError(f"rl.estimator={g.estimator} with algo={c.algo}: PPO's advantages are GAE over its "
                              f"critic's values (rl.estimator=gae or empty), and only --algo ppo has a critic")
    if g.group_size < 2 and c.algo in ("grpo", "rloo") and g.estimator != "reinforce_pp":
        raise ConfigError(f"rl.group_size={g.group_size}: a group-relative advantage needs at least 2 samples")
    rollout = g.prompts_per_step * g.group_size
    minibatch = g.minibatch_size or rollout
    if rollout % minibatch:
        raise ConfigError(
            f"rl.minibatch_size={minibatch} must divide the rollout size "
            f"rl.prompts_per_step * rl.group_size = {g.prompts_per_step} * {g.group_size} = {rollout}"
        )
    if minibatch % g.grad_accum:
        raise ConfigError(f"rl.grad_accum={g.grad_accum} must divide rl.minibatch_size={minibatch}")
    if g.dual_clip_c and g.dual_clip_c <= 1:
        raise ConfigError(f"rl.dual_clip_c={g.dual_clip_c} must be > 1 (or 0 to disable)")
    if g.dual_clip_c and g.policy_loss in ("cispo", "sapo"):
        raise ConfigError(f"rl.dual_clip_c={g.dual_clip_c} with rl.policy_loss={g.policy_loss}: the dual clip bounds "
                          f"ppo_clip's loss; {g.policy_loss} has none (set rl.dual_clip_c=0)")
    if g.clip_cov_ratio and g.clip_cov_lb >= g.clip_cov_ub:
        raise ConfigError(f"rl.clip_cov_lb={g.clip_cov_lb} must be < rl.clip_cov_ub={g.clip_cov_ub}")
    if g.entropy_target:
        if g.entropy_coef_min > g.entropy_coef_max:
            raise ConfigError(f"rl.entropy_coef_min={g.entropy_coef_min} must be <= "
                              f"rl.entropy_coef_max={g.entropy_coef_max}")
        if c.algo == "ppo":
            raise ConfigError(f"rl.entropy_target={g.entropy_target} with algo=ppo: adaptive entropy control is "
                              f"wired into the GRPO family (grpo, rloo, reinforce_pp); set rl.entropy_target=0")
        if not g.entropy_coef_min <= g.entropy_coef <= g.entropy_coef_max:
            raise ConfigError(f"rl.entropy_coef={g.entropy_coef} (adaptive entropy control's start) must lie in "
                              f"[rl.entropy_coef_min, rl.entropy_coef_max] = [{g.entropy_coef_min}, "
                              f"{g.entropy_coef_max}]")
    for i, spec in enumerate(c.rewards):
        _check_number(f"rewards.{i}.weight", spec.weight, (-float("inf"), float("inf"), True))
        _check_number(f"rewards.{i}.timeout_s", spec.timeout_s, _AT_LEAST)
    if not c.out_dir.strip():
        raise ConfigError("out_dir='': a run needs an output directory (e.g. runs/my_run)")


def validate_environment(c: RunConfig) -> None:
    """The input paths, and the mesh and batch sizes against the devices JAX sees (after `jax.distributed` is
    initialised), so a run that cannot start fails before any model loads."""
    import jax

    check_required(c)
    if c.logging.wandb:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError("logging.wandb=true needs the wandb package, which is not installed: pip install "
                              "wandb (or pip install 'jaxrl_llm[wandb]'), or set logging.wandb=false") from None
    for key in ("data.train", "data.eval", "dpo.eval_prompts"):
        source = _get(c, key)
        if source and not source.startswith(("hf:", "python:")) and not Path(source).is_file():
            kind = "a directory, not a JSONL file" if Path(source).is_dir() else "missing"
            raise ConfigError(f"{key}={source}: the data file is {kind} (a JSONL path, or hf:NAME for a hub dataset)")
    from jaxrl_llm.rewards import resolve_reward

    for spec in c.rewards:  # an unknown name or a module that does not import fails here, not after the model load
        resolve_reward(spec.name, dict(spec.kwargs))
    if c.eval_reward:
        resolve_reward(c.eval_reward)
    if not (c.algo == "sft" and c.model.init):
        check_model_source("model.path", c.model.path)
    if c.algo == "ppo" and c.ppo.critic_init != "policy":
        check_model_source("ppo.critic_init", c.ppo.critic_init)

    from jaxrl_llm.sharding import MeshShape

    n = jax.device_count()
    try:
        data, fsdp, _ = MeshShape(c.mesh.data, c.mesh.fsdp, c.mesh.tensor).resolve(n)
    except ValueError as e:
        raise ConfigError(f"mesh.data={c.mesh.data}, mesh.fsdp={c.mesh.fsdp}, mesh.tensor={c.mesh.tensor}: "
                          f"{str(e).split(': ', 1)[-1]}") from e
    ways = data * fsdp
    g = c.rl
    if c.algo in ("sft", "dpo") and c.sft.batch_size % ways:
        raise ConfigError(f"sft.batch_size={c.sft.batch_size} must be divisible by mesh.data * mesh.fsdp ({ways})")
    if c.algo not in ("sft", "rm", "dpo"):
        micro = (g.minibatch_size or g.prompts_per_step * g.group_size) // g.grad_accum
        if micro % ways:
            raise ConfigError(f"the micro-batch rl.minibatch_size / rl.grad_accum = {micro} sequences must be "
                              f"divisible by mesh.data * mesh.fsdp ({ways}) for the data-parallel step")


REWARD_FREE_ALGOS = ("sft", "rm", "dpo")  # trained on examples or pairs; every other algorithm needs `rewards`


def check_required(c: RunConfig) -> None:
    """One line naming every required setting the run lacks (the defaults name no model, data or reward)."""
    missing = []
    if not c.model.path and not (c.algo == "sft" and c.model.init):
        missing.append("model.path (a Hugging Face model directory or hub id)")
    if not c.data.train:
        missing.append("data.train (a JSONL file, or hf:NAME for a hub dataset)")
    if c.algo not in REWARD_FREE_ALGOS and not c.rewards:
        missing.append("rewards (a list such as [{name: math_answer}] or [{name: my_module:my_reward}])")
    if missing:
        raise ConfigError(f"algo={c.algo} needs {'; '.join(missing)}: set {'them' if len(missing) > 1 else 'it'} "
                          f"in the YAML file or on the command line (python train.py --print-config lists every "
                          f"field)")
    if c.algo == "dpo" and c.dpo.eval_prompts and not (c.rewards or c.eval_reward):
        raise ConfigError(f"dpo.eval_prompts={c.dpo.eval_prompts} needs a reward to score the greedy answers: set "
                          f"eval_reward (e.g. math_answer) or rewards")
    if c.data.eval and c.algo not in ("rm", "dpo") and not (c.rewards or c.eval_reward):
        raise ConfigError(f"data.eval={c.data.eval} needs a reward to score the held-out answers: set eval_reward "
                          f"(e.g. math_answer) or rewards, or data.eval='' for no evaluation")


HUB_TIMEOUT_S = 10.0


def check_model_source(key: str, value: str) -> None:
    """`value` is a model directory, or a hub id that is cached or exists on the hub; else a one-line
    `ConfigError` that says which (a local-looking path is "not found", never looked up on the hub)."""
    path = Path(value).expanduser()
    if path.is_dir():
        return
    if path.exists():
        raise ConfigError(f"{key}={value} is a file; it must be a model directory (with config.json) or a hub id")
    if looks_local(value):
        raise ConfigError(f"{key}={value}: not found (no directory {shown_path(path)}; relative paths in a YAML "
                          f"file are relative to its folder, on the command line to the current folder)")
    from huggingface_hub import constants, model_info, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if isinstance(try_to_load_from_cache(value, "config.json"), str):
        return
    where = f"{key}={value}: not a local directory ({shown_path(path)} does not exist), and as a hub id it"
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(f"{where} is not in the local cache (HF_HUB_OFFLINE is set)")
    try:
        model_info(value, timeout=HUB_TIMEOUT_S)
    except GatedRepoError as e:
        raise ConfigError(f"{where} is gated: accept its license on the hub and log in (hf auth login)") from e
    except RepositoryNotFoundError as e:
        raise ConfigError(f"{where} is not on the Hugging Face hub (or is private: log in with hf auth login)") from e
    except Exception as e:  # no network, DNS, proxy, timeout: one line, at once
        raise ConfigError(f"{where} cannot be looked up: the hub is unreachable ({type(e).__name__}: "
                          f"{one_line(str(e))[:120]}); check the path, or download the model while online") from e


def _validate_ppo(p: PPOSection) -> None:
    _choice(p.kl_estimator, "ppo.kl_estimator", ("k1", "k2", "k3"))
    for key in ("gamma", "lam", "value_clip", "critic_learning_rate", "kl_coef_init", "kl_target", "kl_horizon"):
        _check_number(f"ppo.{key}", getattr(p, key), (-float("inf"), float("inf"), True))
    if not 0 <= p.gamma <= 1 or not 0 <= p.lam <= 1:
        raise ConfigError(f"ppo.gamma={p.gamma} and ppo.lam={p.lam} must be in [0, 1]")
    if p.value_clip < 0 or p.kl_coef_init < 0 or p.kl_target < 0 or p.critic_warmup_steps < 0:
        raise ConfigError("ppo.value_clip, ppo.kl_coef_init, ppo.kl_target and ppo.critic_warmup_steps must be >= 0")
    if p.kl_target > 0 and (p.kl_horizon <= 0 or p.kl_coef_init <= 0):
        raise ConfigError("the adaptive KL controller (ppo.kl_target > 0) needs ppo.kl_horizon > 0 and "
                          "ppo.kl_coef_init > 0")
    if p.critic_learning_rate <= 0:
        raise ConfigError(f"ppo.critic_learning_rate={p.critic_learning_rate} must be > 0")


def _resolve(key: str, name: str, registry: dict[str, Any], register: Any) -> str:
    """`name` if in `registry`; a `module:function` is imported and added with `register(name, fn)`."""
    if name in registry:
        return name
    if ":" not in name:
        raise ConfigError(f"{key}={name!r}: expected one of {', '.join(registry)}, or 'module:function' "
                          f"(see docs/extending.md)")
    module_name, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{key}={name!r} cannot be imported: {e}") from e
    register(name, fn)
    return name


def resolve_estimator(name: str) -> str:
    """`name` if registered (`jaxrl_llm.rl.estimators.ADVANTAGE_ESTIMATORS`); a `module:function` is imported and
    registered under that name (its `kl_in_reward` attribute, if any, says where the KL goes)."""
    from jaxrl_llm.rl.estimators import ADVANTAGE_ESTIMATORS, register_estimator

    def register(key: str, fn: Any) -> None:
        register_estimator(key, kl_in_reward=bool(getattr(fn, "kl_in_reward", False)))(fn)

    return _resolve("rl.estimator", name, ADVANTAGE_ESTIMATORS, register)


def resolve_policy_loss(name: str) -> str:
    """`name` if registered (`jaxrl_llm.rl.losses.POLICY_LOSSES`); a `module:function` is imported and registered."""
    from jaxrl_llm.rl.losses import POLICY_LOSSES, register_policy_loss

    return _resolve("rl.policy_loss", name, POLICY_LOSSES, lambda key, fn: register_policy_loss(key)(fn))


def advantage_estimator(c: RunConfig) -> str:
    """The estimator a run uses: `rl.estimator` if set, else the one named by `algo` (else GRPO's)."""
    from jaxrl_llm.rl.estimators import ADVANTAGE_ESTIMATORS

    if c.rl.estimator:
        return resolve_estimator(c.rl.estimator)
    return c.algo if c.algo in ADVANTAGE_ESTIMATORS else "grpo"


def to_dict(config: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def to_yaml(config: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))

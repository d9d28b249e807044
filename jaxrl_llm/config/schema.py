"""The run's configuration schema: one dataclass per section, each field with its default, its one-line help
(the comment beside it: `--print-config` and docs/config-reference.md read it) and its allowed values in the field's
metadata (`at_least`, `positive`, `fraction`, `within`, `finite`, `one_of`), checked by `checks.check_fields`.

Relations between fields that every run shares (the mesh sizes, LoRA's target pattern) are checked there too; those
of one algorithm are its own `validate` (jaxrl_llm.trainers), and what needs the outside world (devices, files,
the hub, plugins) is `jaxrl_llm.preflight`. This module imports nothing of the package but `errors`, `fields` and
the RL math's option types (`jaxrl_llm.rl.options`: `rl.loss` is the policy loss's own `PolicyLossOptions`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jaxrl_llm.algorithms import ALGORITHMS
from jaxrl_llm.fields import at_least, finite, fraction, one_of, positive, within
from jaxrl_llm.models.options import ATTENTION_REQUESTS, REMAT_POLICIES
from jaxrl_llm.rl.options import (
    DISTILL_LOSSES,
    KL_ESTIMATORS,
    PREFERENCE_LOSSES,
    PolicyLossOptions,
)
from jaxrl_llm.sampling.options import SAMPLERS

DTYPES = ("float32", "bfloat16")
# The environments' two choice lists live here, not in `envs/`: that package sits above the config and imports it
# (a leaf of `envs/` would still run its `__init__`, which registers the environments); `envs/` checks its own
# names against these (`tool_formats.py`, `sandbox.py`).
# Where the python tool and the code_tests reward run model code (jaxrl_llm.envs.sandbox, docs/sandbox.md).
SANDBOX_MODES = ("bwrap", "subprocess")
# How a model writes tool calls, and its results come back (jaxrl_llm.envs.tool_formats, docs/environments.md).
TOOL_FORMAT_NAMES = ("auto", "hermes", "llama3_json", "mistral", "qwen3_xml")
@dataclass
class ModelSection:
    """The policy model: where it is, its dtypes and memory knobs."""

    path: str = ""  # required: a Hugging Face model directory or hub id (--algo sft with model.init: unused)
    # compute dtype: float32 | bfloat16 | auto (bfloat16 on a GPU or TPU and on a CPU with bfloat16 dots: AMX,
    # AVX512-BF16, Arm BF16; float32 on any other CPU, where bfloat16 dots are slower; the run header says which)
    dtype: str = one_of("float32", ("auto", *DTYPES))
    param_dtype: str = one_of("float32", DTYPES)  # stored weights: float32 | bfloat16 (float32 master weights are kept)
    remat: bool = False  # recompute each layer's activations in the backward pass (less memory, more time)
    # With remat: what a layer keeps for its backward pass. full: only its input (everything recomputed);
    # matmuls: also its weight matmuls' outputs (attention and elementwise work recomputed; docs/scaling.md)
    remat_policy: str = one_of("full", REMAT_POLICIES)
    # layers per iteration of the training forward's layer loop; the layer count unrolls it completely (no
    # stacked residual buffers: a faster update on XLA:CPU, a longer compile); 1 = a loop over layers
    scan_unroll: int = at_least(1, 1)
    # Memory of one float32 logits block [rows, chunk, V] when the train step and the reference pass compute
    # log-probs and entropy from the final hidden states (MiB); 0 = all completion positions in one block.
    logprob_block_mib: float = at_least(256.0)
    # Full-sequence attention takes at most this many queries at a time (float32 scores [B, H, chunk, S], not
    # [B, H, T, S]); 0 = all queries at once.
    attention_query_chunk: int = at_least(128)
    # The training forward's attention (the update, the log-prob passes): auto = the platform's flash kernel where
    # it covers the layer (Pallas on GPU and TPU, else cuDNN on NVIDIA), else XLA; xla | pallas | cudnn. A layer the
    # kernel cannot run (a window, a soft cap, sinks) runs on XLA; the run's header says which path each kind takes.
    attention: str = one_of("auto", ATTENTION_REQUESTS)
    # --algo sft only: architecture of a model trained from scratch (HF config.json keys, with model_type),
    # and its tokenizer: a directory, or "arithmetic" for the default task's character tokenizer.
    init: dict[str, Any] = field(default_factory=dict)
    tokenizer: str = ""  # --algo sft with model.init: a tokenizer directory, or "arithmetic"
    # Mixture-of-experts models only. The router's load-balancing loss (transformers' formula) times this is added
    # to every algorithm's loss; 0 (the default, as verl, NeMo-RL and slime in RL): it moves the log-probs.
    router_aux_loss_coef: float = at_least(0.0)
    freeze_router: bool = False  # MoE: the routers get no update (their gradient and weight decay are zero)


@dataclass
class DataSection:
    """Training and held-out data: files or hub datasets, which fields hold what, prompt rendering."""

    # required: a JSONL path, hf:NAME[:CONFIG] for a hub dataset, or reasoning_gym:TASK?size=N&seed=S&OPTION=VALUE
    # for problems generated by reasoning-gym (reward: reasoning_gym; docs/configuration.md)
    train: str = ""
    # held-out prompts for greedy accuracy (JSONL, hf:NAME or reasoning_gym:TASK on other seeds; its problems that
    # data.train holds are skipped); "" = no evaluation
    eval: str = ""
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
    max_prompt_tokens: int = at_least(512, 1)  # longer prompts are dropped (with a count), never cut
    shuffle: bool = True  # reshuffle the training records every epoch (seeded)


@dataclass
class SamplingSection:
    """How rollouts are sampled (the held-out evaluation decodes greedily with the same length limit)."""

    # completion length limit; a longer completion is cut (counted in frac_truncated)
    max_new_tokens: int = at_least(256, 1)
    temperature: float = positive(1.0)  # rollout sampling temperature (evaluation is greedy)
    top_k: int = at_least(0)  # 0 = off
    top_p: float = within(1.0, 0.0, 1.0, low_open=True)  # nucleus sampling; 1 = off
    min_p: float = fraction(0.0)  # drop tokens below min_p * the top probability; 0 = off
    # Compile buckets: prompt widths and completion lengths are rounded up to these multiples, so calls with
    # lengths in one bucket reuse one compiled sampler / train step. Smaller = less padding, more compiles.
    prompt_bucket: int = at_least(16, 1)
    new_tokens_bucket: int = at_least(16, 1)  # completion lengths are rounded up to a multiple of this
    # paged = the rollout engine (continuous batching over a paged KV cache, a group's prompt prefilled once and
    # shared, a multi-turn conversation's next turn prefilling only the new tokens; docs/engine.md); static = one
    # batch, every prompt prefilled, then decoded to the longest row (a longrope model past its original context)
    engine: str = one_of("paged", SAMPLERS)
    # paged: tokens per page; 0 = the platform's (`engine.pages.default_page_size`: 64 on the CPU, 16 on GPU and TPU)
    engine_page_size: int = at_least(0)
    engine_slots: int = at_least(0)  # paged: sequences decoding at once; 0 = every row of the call
    engine_steps_per_call: int = at_least(16, 1)  # paged: decode steps per device call between scheduling points
    # paged: pages in the pool; 0 = what the call's rows need at their token limit (prompts counted once per
    # group); a smaller pool queues sequences until pages free
    engine_pages: int = at_least(0)
    # paged: the decode step's attention. auto = a Pallas paged-attention kernel over the pages on GPU (Triton) and
    # TPU (head sizes that are multiples of 128), on the CPU the project's C++ kernel (built on first use; xla where
    # no C++ compiler is found); xla; cpu = the C++ kernel; pallas = the Pallas kernel (on the CPU the GPU kernel in
    # Pallas' interpreter: slow, for checking). Sliding-window models use xla on GPU and TPU (docs/engine.md).
    engine_attention: str = one_of("auto", ("auto", "xla", "cpu", "pallas"))
    # the sampler's compute dtype (and its weights'), for rollouts and the held-out evaluation: "" = model.dtype;
    # bfloat16 under a float32 model samples as a bf16 inference server beside a float32 trainer does (`mismatch/*`)
    dtype: str = one_of("", ("", *DTYPES))


@dataclass
class RLSection:
    """The RL loop (GRPO family and PPO): rollout sizes, the update's epochs and minibatches, the policy loss
    and the advantage estimator (both picked by name from their registries)."""

    prompts_per_step: int = at_least(16, 1)  # P
    group_size: int = at_least(8, 1)  # G: samples per prompt
    mu: int = at_least(1, 1)  # optimisation passes over each rollout
    minibatch_size: int = at_least(0)  # sequences per optimizer step; 0 = the whole rollout (P * G)
    grad_accum: int = at_least(1, 1)  # micro-batches per optimizer step (divides minibatch_size)
    # the update's forward pass on packed rows: each micro-batch's sequences laid end to end, no padding computed
    # (block-diagonal attention; the losses are the padded layout's), whenever that takes fewer rows than padding
    # and the update is large enough to gain (rl.packing_min_gflops); false = always padded to the longest sequence
    packing: bool = True
    # pack only micro-batches whose padded forward is at least this many GFLOP (2 x parameters x positions): smaller
    # updates are bound by dispatch and compilation, not by padding (docs/packing.md); 0 = whenever rows are saved
    packing_min_gflops: float = at_least(50.0)
    # > 0 (with rl.packing): micro-batches by tokens, not rl.grad_accum: each step splits its minibatches into the
    # fewest micro-batches (a divisor of rl.minibatch_size) whose real tokens average at most this, the sequences
    # dealt by length so every micro-batch holds about as many (verl's ppo_max_token_len_per_gpu)
    max_tokens_per_microbatch: int = at_least(0)
    # rl.surrogates.POLICY_LOSSES: ppo_clip (token ratio) | gspo (sequence ratio) | cispo (clipped IS weight,
    # MiniMax-M1) | sapo (soft gate, SAPO) | module:function
    policy_loss: str = "ppo_clip"
    # the surrogate's own keywords, beyond rl.loss (sapo: {tau_pos: 1.0, tau_neg: 1.05}); a plugin's settings too
    policy_loss_kwargs: dict[str, Any] = field(default_factory=dict)
    loss: PolicyLossOptions = field(default_factory=PolicyLossOptions)
    beta: float = at_least(0.0)  # KL coefficient to the reference model; 0 skips the reference pass
    # group | batch (group mean, std of the whole batch) | none (Dr.GRPO)
    scale_rewards: str = one_of("group", ("group", "batch", "none"))
    entropy_coef: float = finite(0.0)  # adds -entropy_coef * entropy to the loss (the start value when adaptive)
    # > 0: adaptive entropy control (Skywork-OR1, GRPO family): entropy_coef moves by entropy_coef_delta per step,
    # up while the mean entropy per token is below this target (nats) and down above it, and the bonus is applied
    # only below it; 0 = entropy_coef stays fixed
    entropy_target: float = at_least(0.0)
    entropy_coef_delta: float = at_least(0.005)  # adaptive entropy control: change of entropy_coef per step
    entropy_coef_min: float = at_least(0.0)  # adaptive entropy control: entropy_coef's lower bound
    entropy_coef_max: float = at_least(1.0)  # adaptive entropy control: entropy_coef's upper bound
    # Advantage estimator: "" = the algorithm's own (grpo, rloo, reinforce_pp); or reinforce_pp_baseline.
    estimator: str = ""
    # MoE: the experts the update's forward uses: none (its own router's choice) | old (those the old policy's pass
    # chose, replayed in every minibatch: R2) | rollout (those the sampler chose, prefill and decode: R3); the gate
    # weights always come from the live router, so it keeps learning (docs/models.md)
    routing_replay: str = one_of("none", ("none", "old", "rollout"))
    dynamic_sampling: bool = False  # DAPO: drop zero-variance groups and refill the batch
    max_refill_rounds: int = at_least(3)  # DAPO: extra sampling rounds per step at most


@dataclass
class PPOSection:
    """--algo ppo only; the loop's knobs (prompts_per_step, group_size, mu, minibatch_size, entropy_coef) are in
    `rl`, the clip range in `rl.loss`. The KL to the reference is in the per-token reward, not in the loss."""

    gamma: float = fraction(1.0)  # discount over completion tokens
    lam: float = fraction(0.95)  # GAE lambda
    value_clip: float = at_least(0.2)  # clip range of V around the rollout's values; 0 = no value clipping
    critic_learning_rate: float = positive(5.0e-4)  # the critic's own AdamW (same schedule / warmup as optim)
    critic_warmup_steps: int = at_least(0)  # first steps train only the critic (the policy is not updated)
    critic_init: str = "policy"  # "policy" (a copy of its decoder) or a model directory (e.g. a reward model)
    kl_coef_init: float = at_least(0.01)  # beta of r_t = -beta * KL_t + [t = last] * score
    kl_estimator: str = one_of("k1", KL_ESTIMATORS)  # the per-token KL in the reward: k1 | k2 | k3
    kl_target: float = at_least(0.0)  # adaptive controller target (mean KL per token); 0 = fixed coefficient
    kl_horizon: float = finite(10000.0)  # adaptive controller horizon, in samples
    whiten_advantages: bool = True  # normalise GAE advantages over the batch


@dataclass
class DPOSection:
    """--algo dpo: preference optimisation on (prompt, chosen, rejected) pairs, against a frozen reference."""

    # sigmoid (DPO) | ipo | hinge (SLiC) | simpo (reference-free, length-normalised)
    loss: str = one_of("sigmoid", PREFERENCE_LOSSES)
    # the implicit reward is beta * (log pi - log pi_ref) of a response (simpo: of its mean)
    beta: float = positive(0.1)
    # sigmoid / simpo: the share of flipped labels assumed (conservative DPO)
    label_smoothing: float = within(0.0, 0.0, 0.5)
    simpo_gamma: float = at_least(0.5)  # simpo: the target reward margin
    # Reference log-probs: "step" = a frozen copy's, computed inside each jitted step; "precompute" = once for
    # the whole dataset before training (no reference weights kept during the updates).
    reference: str = one_of("step", ("step", "precompute"))
    eval_prompts: str = ""  # prompts with answers (JSONL / hf:NAME) for greedy task accuracy; "" = none


@dataclass
class DistillSection:
    """--algo distill: on-policy distillation from a frozen teacher that shares the student's tokenizer. The student
    samples as the GRPO family does (rl.prompts_per_step x rl.group_size, single- or multi-turn) and `rl` sizes its
    update; the run's rewards are logged and evaluated, and trained on only with `reward_weight`."""

    teacher: str = ""  # required: the teacher's Hugging Face directory or hub id (any family, the same tokenizer)
    # reverse_kl: each sampled token's advantage is kl_coef * (log pi_teacher - log pi_student) (on-policy
    # distillation); jsd: GKD's generalised Jensen-Shannon divergence over the full vocabulary at every position
    loss: str = one_of("reverse_kl", DISTILL_LOSSES)
    kl_coef: float = positive(1.0)  # reverse_kl: the teacher's per-token signal's scale
    # reverse_kl: + reward_weight x the GRPO advantage of the run's rewards (0 = the teacher's signal alone)
    reward_weight: float = at_least(0.0)
    beta: float = within(0.5, 0.0, 1.0)  # jsd: 0 = forward KL(teacher || student), 1 = reverse KL, between: JSD
    # jsd: the share of steps the student samples its completions (GKD's lambda); the other steps train on the
    # data's answers (data.answer_field + EOS; single-turn only)
    lmbda: float = fraction(0.5)


@dataclass
class LoraSection:
    """LoRA adapters (jaxrl_llm.models.lora) for the GRPO family, PPO's policy, SFT and DPO: the base weights are frozen
    (no gradients, no optimizer state) and double as the reference model (adapters off)."""

    rank: int = at_least(0)  # r; 0 = no LoRA (full fine-tuning)
    alpha: float = positive(16.0)  # the update is scaled by alpha / rank
    # dropout on the adapters' input in the update (PEFT's lora_dropout); off when sampling
    dropout: float = within(0.0, 0.0, 1.0, high_open=True)
    # Regular expression searched in each layer kernel's HF module name (model.layers.0.self_attn.q_proj, ...).
    targets: str = "(q|k|v|o|gate|up|down)_proj"
    export_adapters: bool = False  # also write the adapters in PEFT format (out_dir/hf/adapter) at export


@dataclass
class RewardSpec:
    """One reward function of the weighted sum."""

    name: str = ""  # a built-in (math_answer, math_verify, format, overlong, reward_model) or "module:function"
    weight: float = finite(1.0)  # the step's reward is the weighted sum of the functions
    kwargs: dict[str, Any] = field(default_factory=dict)  # keywords bound to the function (e.g. {path: DIR})
    # seconds a call may take, else the run stops with an error naming the function (0 = no limit); a call
    # still running after 10 s prints a notice on stderr, so a stall is never silent
    timeout_s: float = at_least(300.0)


@dataclass
class OptimSection:
    """AdamW (optax) with warmup, a schedule and gradient clipping."""

    learning_rate: float = positive(1e-5)  # AdamW peak learning rate
    warmup_steps: int = at_least(0)  # linear warmup from 0
    # constant | cosine | linear (decay to end_lr_ratio * lr after warmup)
    schedule: str = one_of("constant", ("constant", "cosine", "linear"))
    end_lr_ratio: float = fraction(0.0)  # cosine / linear: the final learning rate as a fraction of the peak
    weight_decay: float = at_least(0.0)  # AdamW decoupled weight decay
    beta1: float = within(0.9, 0.0, 1.0, high_open=True)  # AdamW first-moment decay
    beta2: float = within(0.99, 0.0, 1.0, high_open=True)  # AdamW second-moment decay
    max_grad_norm: float = at_least(1.0)  # global-norm gradient clipping; 0 = off


@dataclass
class SFTSection:
    """Batch sizes of the supervised algorithms (--algo sft, rm and dpo)."""

    batch_size: int = at_least(64, 1)  # --algo sft / rm / dpo: examples (pairs) per optimizer step
    eval_batch_size: int = at_least(256, 1)  # --algo sft / rm / dpo: examples (pairs) per evaluation batch
    # --algo sft / rm / dpo: each batch's sequences laid end to end in packed rows when that takes fewer rows and
    # the batch's padded forward is at least sft.packing_min_gflops GFLOP (as rl.packing); false = always padded
    packing: bool = True
    packing_min_gflops: float = at_least(50.0)  # --algo sft / rm / dpo: as rl.packing_min_gflops, for a whole batch


@dataclass
class MeshSection:
    """Device mesh (see `jaxrl_llm.sharding`): data * fsdp * expert * sequence * tensor = all devices; one axis may
    be -1."""

    data: int = -1  # data parallel: params replicated, batch split
    fsdp: int = 1  # batch split, params and optimizer state sharded
    tensor: int = 1  # attention heads and MLP columns split
    expert: int = 1  # mixture of experts: each device holds num_experts / expert of the experts; batch split
    # context parallelism: each sequence's positions split over this many devices in the update and the log-prob
    # passes (attention over all-gathered keys and values; rows padded to a multiple; docs/scaling.md)
    sequence: int = 1


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
class MonitorSection:
    """The run's health checks (`jaxrl_llm.run.monitor`): each named check logs a hint when it starts; the
    divergence checks (a collapse that holds `patience` steps in a row) end the run under on_divergence=stop."""

    warnings: bool = True  # run the warning checks (the divergence checks follow patience and on_divergence)
    # stop: end the run at a divergence, keep the last good checkpoint, no export | warn: log only
    on_divergence: str = one_of("stop", ("stop", "warn"))
    # steps in a row a divergence (or zero-variance groups) must hold; 0 = no divergence checks
    patience: int = at_least(5)
    # divergence: entropy below it (nats/token), the policy collapsed to one answer
    entropy_floor: float = at_least(0.01)
    # divergence: entropy above this fraction of log V (noise)
    entropy_ceiling: float = within(0.95, 0.0, 1.0, low_open=True)
    kl_max: float = positive(10.0)  # divergence: mean KL to the reference per token (nats) above it
    reward_stuck: bool = True  # divergence: every completion scored the same, and the same as the last step
    kl_warn: float = positive(1.0)  # warning kl_blowup: kl or drift_kl per token (nats) above it
    baseline_steps: int = at_least(3, 1)  # the first N steps are the baseline of the entropy and length ratios
    empty_fraction: float = fraction(0.5)  # share of empty completions that names empty_completions
    # share of completions cut at sampling.max_new_tokens that names truncated
    truncated_fraction: float = fraction(0.5)
    # steps of one reward for all completions that name reward_zero / reward_constant
    reward_steps: int = at_least(10, 1)
    # entropy below this share of its baseline (reward no better): entropy_collapse
    entropy_ratio: float = at_least(0.1)
    # mean length below this share of its baseline (reward no better): length_collapse
    length_low: float = at_least(0.25)
    length_high: float = positive(4.0)  # mean length above this multiple of its baseline: length_explosion
    repetition: float = fraction(0.5)  # share of repeated 3-grams in the completions that names repetition
    # frac_zero_std_groups at or above it for `patience` steps: zero_variance_groups
    zero_std_groups: float = fraction(0.95)
    # throughput_drop: the median tokens/s of the last `throughput_window` steps below this x the median before
    throughput_ratio: float = at_least(0.5)
    throughput_window: int = at_least(10, 1)  # steps of the recent median that throughput_ratio compares
    max_skipped_updates: int = at_least(5, 1)  # consecutive updates skipped for non-finite gradients that stop the run
    # KL(pi || pi_initial) per token on this many rollout rows at each evaluation step, logged as drift_kl even
    # when rl.beta = 0 (a copy of the initial weights is kept on the host); 0 = off
    drift_rows: int = at_least(64)


@dataclass
class EnvSection:
    """Multi-turn rollouts (GRPO family): each row is an episode with an environment (`jaxrl_llm.envs`); the
    model's turns are sampled, the environment's messages are appended as the chat template renders them, and
    the loss covers the model's tokens only. name "" = single-turn (one completion per prompt)."""

    name: str = ""  # "" (single-turn) | tool_use | a registered name | module:function (factory(record, **kwargs))
    kwargs: dict[str, Any] = field(default_factory=dict)  # keywords bound to the environment's factory
    tools: list[str] = field(default_factory=list)  # tools the model may call: calculator | python | module:attr
    # how calls are parsed from the model's text and results rendered: auto (from the chat template; hermes when it
    # has no tool support) | hermes | llama3_json | mistral | qwen3_xml
    tool_format: str = one_of("auto", TOOL_FORMAT_NAMES)
    max_turns: int = at_least(4, 1)  # the model's turns per episode at most
    # completion tokens per episode at most (the model's and the environment's); sampling.max_new_tokens per turn
    max_tokens: int = at_least(512, 1)
    # an environment's step (or start) not done within this ends its episode with an error; nothing waits for it
    timeout_s: float = positive(30.0)
    workers: int = at_least(8, 1)  # environment steps run in this many threads at once (they may block on tools)
    # where the python tool and the code_tests reward run model code: bwrap (bubblewrap, a minimal read-only view,
    # no network) | subprocess (opt-in: a plain subprocess under rlimits, without isolation)
    sandbox: str = one_of("bwrap", SANDBOX_MODES)


@dataclass
class RolloutSection:
    """Sampling beside training (the GRPO family and distillation; docs/overlap.md): the sampler's own devices,
    and how many policy versions its rollouts may lag the update that consumes them."""

    # devices of the sampler's own mesh (the last N that JAX sees; weights replicated, rows split); the trainer's
    # mesh (mesh.*) is the rest, and the weights go to the sampler in memory after each update; 0 = one mesh for both
    sampler_devices: int = at_least(0)
    # the sampler mesh's tensor-parallel degree: each weight matrix split over this many of its devices (as
    # mesh.tensor splits the trainer's), rows over the rest; 1 = weights replicated on each sampler device
    sampler_tensor: int = at_least(1)
    # K: the rollout of step s is sampled by the policy of step s-1-K (or the first), on a thread beside the
    # update, so sampling runs up to K steps ahead; 0 = synchronous: sample, then update (today's run, bit for bit).
    # With K > 0, rl.loss.rollout_correction is token_truncate unless set
    max_staleness: int = at_least(0)
    # with max_staleness > 0: allow rl.loss.rollout_correction=none or recompute (no importance weight between
    # the policy that sampled and the one the update starts from)
    allow_uncorrected: bool = False


# rl.loss.rollout_correction when rollout.max_staleness > 0 and the config does not set it: truncated importance
# sampling per token (the trainer's recomputed log-probs over the stale sampler's, capped)
STALE_ROLLOUT_CORRECTION = "token_truncate"


@dataclass
class LoggingSection:
    """Where metrics go besides metrics.jsonl and TensorBoard."""

    wandb: bool = False  # also send every metrics row to Weights & Biases (pip install wandb)
    wandb_project: str = "jaxrl_llm"  # the W&B project
    wandb_mode: str = one_of("offline", ("offline", "online"))  # offline (no network; `wandb sync` later) | online


@dataclass
class RunConfig:
    """A whole run."""

    algo: str = one_of("grpo", tuple(ALGORITHMS))  # the algorithm (jaxrl_llm/algorithms.py lists them)
    seed: int = at_least(0)  # the run's root random key (sampling, data order, dropout-free init)
    steps: int = at_least(100)  # training steps (one rollout + update each, for the RL algorithms)
    out_dir: str = "runs/default"  # metrics, samples, checkpoints and the export go here
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    sampling: SamplingSection = field(default_factory=SamplingSection)
    rl: RLSection = field(default_factory=RLSection)
    sft: SFTSection = field(default_factory=SFTSection)
    ppo: PPOSection = field(default_factory=PPOSection)
    dpo: DPOSection = field(default_factory=DPOSection)
    distill: DistillSection = field(default_factory=DistillSection)
    lora: LoraSection = field(default_factory=LoraSection)
    rewards: list[RewardSpec] = field(default_factory=list)  # required for RL: [{name: ..., weight: ...}, ...]
    optim: OptimSection = field(default_factory=OptimSection)
    mesh: MeshSection = field(default_factory=MeshSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)
    monitor: MonitorSection = field(default_factory=MonitorSection)
    env: EnvSection = field(default_factory=EnvSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    log_every: int = at_least(1, 1)  # a metrics row (and a plain log line when not on a terminal) every N steps
    sample_every: int = at_least(10)  # write sample completions with rewards at step 1 and every N steps (0 = never)
    # Held-out accuracy = share of greedy answers this reward scores exactly 1: a built-in name or
    # module:function; "" = the first of `rewards` (set it when that one is not a 0/1 check, e.g. a reward model).
    eval_reward: str = ""
    eval_every: int = at_least(0)  # held-out greedy evaluation every N steps (0: only before and after)
    eval_size: int = at_least(256)  # held-out prompts per evaluation (0: all)
    eval_batch_size: int = at_least(256, 1)  # prompts per greedy evaluation batch
    checkpoint_every: int = at_least(50)  # orbax checkpoint every N steps, and at the end (0 = never)
    keep_checkpoints: int = at_least(2, 1)  # the newest K checkpoints are kept
    # full: the final checkpoint holds the optimizer state too (an exact --resume); weights: only the policy
    # weights are kept at the end of a finished run (earlier checkpoints and optimizer moments deleted).
    final_checkpoint: str = one_of("full", ("full", "weights"))
    export: bool = True  # write the final policy as a Hugging Face directory
    export_dir: str = ""  # default: out_dir/hf
    tensorboard: bool = True  # TensorBoard events under out_dir/tensorboard
    progress_bar: bool = True  # a tqdm bar on a terminal; plain log lines otherwise
    report: bool = True  # train.py writes out_dir/report/report.html (python -m jaxrl_llm report) at the end

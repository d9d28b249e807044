"""One GRPO step: jaxrl_llm's `GRPOTrainer` vs TRL's `GRPOTrainer` (torch, CPU), same model, prompts and reward.

    pip install trl        # benchmark-only dependency (not a runtime dependency of jaxrl_llm)
    python bench/grpo_vs_trl.py [--steps 5] [--warmup 2] [--prompt-tokens 20] [--threads 2] [--wait-quiet 120]
                                [--bf16] [--remat] [--override KEY=VALUE] [--skip-trl] [--model DIR] [--varied]
                                [--no-padded]

The model is a ~10M-parameter Qwen2-shaped decoder (q/k/v biases, GQA, tied embeddings: hidden 256, 10 layers,
4 heads, 2 KV heads, MLP 1024; 9.97M parameters) with random weights and the 512-token stories260K tokenizer,
built with transformers and saved to a temporary directory from which both trainers load it (float32).
`--model DIR` takes any HF causal-LM directory instead (e.g. SmolLM2-135M-Instruct from
`../shared/models/smollm2-135m-instruct/fetch.py`); its prompts are then chat messages rendered with the model's
chat template on both sides (ours `data.chat_template=true`, TRL's conversational prompts), all of exactly
`--prompt-tokens` tokens (default: the most common length among the candidates).

One step, on both sides: 4 prompts x G = 8 samples = 32 completions of exactly 32 new tokens (temperature 1,
no top-k/top-p; EOS is forbidden: `min_new_tokens = 32` for TRL, no EOS ids for ours), a cheap rule reward
(vowel fraction of the completion text), group-normalised advantages, the reference model's log-probs
(beta = 0.04, k3 KL), and one AdamW update over the whole rollout (mu = 1, one minibatch, token-mean loss):
TRL with per_device_train_batch_size = 32, steps_per_generation = 1, gradient_accumulation_steps = 1,
num_iterations = 1 (so it takes the old log-probs as the detached current ones, as we take the sampler's),
AdamW (torch's fused), and no gradient checkpointing on either side unless `--remat` (TRL's default is on).
Every prompt has exactly `--prompt-tokens` tokens (BOS included), so neither side pads within a batch; ours
still rounds the prompt width up to a multiple of 16 (the trainer's compile bucket), which counts as its cost.

`--varied` (with `--model`, a chat model): the step of the packing issue, lengths that vary. 8 prompts x G = 8
samples, up to 128 new tokens, **EOS on** on both sides, prompts of two kinds (a question answered in a word or a
number, and a request for a story or an explanation), so completion lengths range from a few tokens to the limit.
Ours runs with `rl.packing=true`; after each rollout it also runs the **padded update on the same rollout** from
a copy of the same state (timed apart, discarded), and reports both updates' padding fractions
(`update/padding_frac`), their times, their rate of real (non-pad) positions per second, and the packed update's
time against its ideal (the padded time x packed positions / padded positions); `--no-padded` skips that
padded update (the step comparison alone).

Both sides run in this process, never at the same time: our warm-up (`--warmup` steps; the first compiles), TRL's
warm-up, then `--steps` timed steps of each in turn (TRL, ours, TRL, ours, ...; torch with
`torch.set_num_threads`), so a slow drift of the machine's speed hits both alike. The median and the minimum
over the timed steps are printed. Ours: `collect` + `update` (+ the step's metrics), as `GRPOTrainer.run`
does; TRL: from `on_step_begin` to `on_step_end` (generation, rewards, reference pass, loss, backward,
optimizer). The parts are timed by wrapping the sampler, the reference pass and the train step (ours, with a
device sync each), and `_generate`, `_calculate_rewards` and the reference model's
`_get_per_token_logps_and_entropies` (TRL).

Shared machines: both sides want every core, and torch's OpenMP threads degrade by 10-20x when another process
takes a core (spin-waiting), JAX's by ~2x. Each step prints the CPU fraction other processes used during it
(from /proc/stat); `--wait-quiet S` waits up to S seconds before every timed step for the machine to go idle.

Model FLOPs of the update (the useful work; padding excluded). Per row with prompt length p and c completion
tokens, one forward pass covers S = p + c - 1 positions and unembeds the c positions that predict completion
tokens:
    F_fwd = 2 * N_layers * S + 2 * d * V * c + 4 * L * H * hd * (1 + 2 + ... + S)
(N_layers: the matrices of the decoder layers; d * V: the tied output matrix; the last term: q.k and p.v over
the context each position sees). The update is one reference forward plus the policy's forward and backward
(backward = 2 x forward): F_update = 32 rows x 4 x F_fwd, i.e. the usual `8 * N * tokens` (6 N T for training,
2 N T for the reference) with N split into what each token really multiplies, plus attention.
It is reported as achieved FLOP/s over the FLOP/s of a plain jitted 1024^3 matmul (float32, or bfloat16 with
`--bf16`) measured in this run (best of 50, before and after our side).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from common import (
    QWEN2_STORIES_10M,
    add_switches,
    jax_matmul_flops,
    model_dims,
    random_hf_model,
    torch_matmul_flops,
    update_flops,
)

STORIES260K = Path(os.environ.get("STORIES260K", "/work/shared/models/stories260K"))
PROMPTS_PER_STEP, GROUP, NEW_TOKENS, BETA, LR = 4, 8, 32, 0.04, 1e-5
VARIED = False  # --varied: 8 x 8, up to 128 new tokens, EOS on, prompts that ask for short and long answers
PADDED = False  # --varied without --no-padded: the padded update on each rollout beside the packed one


def use_varied_shape() -> None:
    """`--varied`: the shape of the packing issue's comparison (module docstring)."""
    global PROMPTS_PER_STEP, GROUP, NEW_TOKENS, VARIED
    PROMPTS_PER_STEP, GROUP, NEW_TOKENS, VARIED = 8, 8, 128, True


SHORT_QUESTIONS = ["What is {a} + {b}? Reply with the number only.", "Name one {kind}. One word only.",
                   "Is {a} larger than {b}? Answer yes or no."]
LONG_REQUESTS = ["Write a story about a {kind} that finds a {thing}.", "Explain in detail how a {thing} works.",
                 "Describe a day in the life of a {kind}, hour by hour."]


def varied_prompts() -> list[list[dict]]:
    """Chat prompts, half asking for a word or a number and half for a long text, interleaved so every step has
    both kinds (256 of them)."""
    kinds, things = ["animal", "color", "fruit", "bird", "tree"], ["clock", "bicycle", "kite", "lamp", "boat"]
    rng = np.random.default_rng(0)
    out = []
    for i in range(256):
        template = (SHORT_QUESTIONS if i % 2 == 0 else LONG_REQUESTS)[(i // 2) % 3]
        text = template.format(a=int(rng.integers(2, 99)), b=int(rng.integers(2, 99)),
                               kind=kinds[int(rng.integers(5))], thing=things[int(rng.integers(5))])
        out.append([{"role": "user", "content": text}])
    return out


def vowel_reward(prompts, completions, **fields) -> list[float]:
    """The shared rule reward: fraction of the completion's characters that are vowels (cheap, varied).
    TRL passes conversational completions as `[{"role": "assistant", "content": ...}]`: their text is scored."""
    texts = [c if isinstance(c, str) else "".join(m["content"] for m in c) for c in completions]
    return [sum(ch in "aeiouAEIOU" for ch in t) / max(len(t), 1) for t in texts]


# ------------------------------------------------------------------------------------------------ set-up


def build_task(root: Path, prompt_tokens: int | None, model: str = "") -> tuple[Path, Path, list, int]:
    """Model dir (random Qwen2 with the stories260K tokenizer, or `model`) and a JSONL of prompts of exactly
    `prompt_tokens` tokens (chat messages for `model`); returns `(model_dir, data, prompts, prompt_tokens)`."""
    from transformers import AutoTokenizer

    if VARIED:  # prompts of their own lengths (left-padded on our side, as any batch of real prompts)
        prompts = varied_prompts()
        data = root / "prompts.jsonl"
        data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        return Path(model), data, prompts, 0
    if model:
        model_dir = Path(model)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    else:
        tokenizer = AutoTokenizer.from_pretrained(STORIES260K)
        model_dir = root / "qwen2-10m"
        random_hf_model(QWEN2_STORIES_10M, out_dir=model_dir)
        tokenizer.save_pretrained(model_dir)

    def length(text: str) -> int:
        if not model:
            return len(tokenizer(text)["input_ids"])
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        return len(ids["input_ids"] if hasattr(ids, "keys") else ids)

    names = ["Lily", "Tom", "Sue", "Ben", "Mia", "Max", "Anna", "Sam", "Lucy", "Tim", "Jack", "Emma"]
    things = ["ball", "cat", "dog", "box", "tree", "car", "cake", "bird", "book", "hat", "fish", "toy"]
    places = ["park", "garden", "house", "forest", "school", "shop", "river", "farm"]
    templates = ["{n} found a {o} in the {p}.", "{n} found a {o} in the {p}. Then", "{n} saw a {o}.",
                 "One day, {n} found a {o} in the {p}. Then", "{n} and the {o} went to the {p}."]
    candidates = [(t.format(n=n, o=o, p=p)) for t, n, o, p in itertools.product(templates, names, things, places)]
    lengths = [length(text) for text in candidates]
    if prompt_tokens is None:
        prompt_tokens = 20 if not model else max(set(lengths), key=lengths.count)
    prompts = [text for text, n in zip(candidates, lengths, strict=True) if n == prompt_tokens]
    if len(prompts) < 64:
        raise SystemExit(f"only {len(prompts)} prompts of exactly {prompt_tokens} tokens; try another --prompt-tokens")
    prompts = [prompts[i] for i in np.random.default_rng(0).permutation(len(prompts))[:256]]
    if model:  # conversational: both trainers render them with the model's chat template
        prompts = [[{"role": "user", "content": p}] for p in prompts]
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return model_dir, data, prompts, prompt_tokens


class CpuMeter:
    """CPU time the *other* processes of the machine used while this one ran (from /proc/stat and os.times):
    a timed section is only trustworthy when this is near 0, since both sides want every core."""

    def __init__(self) -> None:
        self.start = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float]:
        busy = 0.0
        try:
            with open("/proc/stat") as f:
                fields = [float(v) for v in f.readline().split()[1:]]
            busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait
        except (OSError, ValueError, IndexError):
            pass
        own = os.times()
        return time.perf_counter(), busy, own.user + own.system

    def others(self) -> float:
        """Fraction of all CPUs used by other processes since construction."""
        wall0, busy0, own0 = self.start
        wall1, busy1, own1 = self._read()
        return max(0.0, (busy1 - busy0) - (own1 - own0)) / max((wall1 - wall0) * (os.cpu_count() or 1), 1e-9)


def wait_until_quiet(limit_s: float, threshold: float = 0.05, window_s: float = 1.0) -> float:
    """Wait (up to `limit_s`) until other processes use under `threshold` of the CPUs over `window_s`;
    returns the seconds waited."""
    start = time.perf_counter()
    while limit_s > 0 and time.perf_counter() - start < limit_s:
        meter = CpuMeter()
        time.sleep(window_s)
        if meter.others() < threshold:
            break
    return time.perf_counter() - start


# ------------------------------------------------------------------------------------------------ ours


class Timer:
    """Accumulates the wall time of wrapped calls per name (reset per step)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    def wrap(self, name, fn, block=None):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if block is not None:
                out = block(out)
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t0
            return out

        return timed

    def take(self) -> dict[str, float]:
        out, self.totals = self.totals, {}
        return out


class Ours:
    """Our side: the GRPO algorithm of the loop shell, built from dotted overrides; `step()` runs and times one
    GRPO step (collect + update, as `trainers.loop.Trainer.run_step` does)."""

    def __init__(self, model_dir: Path, data: Path, out_dir: Path, bf16: bool, quiet_s: float,
                 overrides: list[str], chat: bool = False) -> None:
        import jax

        from jaxrl_llm.config import load_run_config
        from jaxrl_llm.data import DataState
        from jaxrl_llm.trainers.grpo import GRPOFamily

        t_setup = time.perf_counter()
        config = load_run_config(None, [
            f"model.path={model_dir}", f"data.train={data}", "data.eval=''", "data.max_prompt_tokens=64",
            f"out_dir={out_dir}", f"rl.prompts_per_step={PROMPTS_PER_STEP}", f"rl.group_size={GROUP}",
            f"rl.beta={BETA}", "rl.mu=1", f"sampling.max_new_tokens={NEW_TOKENS}", "sampling.temperature=1.0",
            f"optim.learning_rate={LR}", f"rewards=[{{name: '{__name__}:vowel_reward'}}]", "progress_bar=false",
            "tensorboard=false", "checkpoint_every=0", "export=false",
            f"model.dtype={'bfloat16' if bf16 else 'float32'}", f"data.chat_template={str(chat).lower()}",
            *(["rl.packing=true", "rl.packing_min_gflops=0"] if VARIED else []), *overrides,
        ])
        self.trainer = trainer = GRPOFamily(config)
        if not VARIED:  # never stop early: exactly NEW_TOKENS tokens per row, like TRL's min_new_tokens
            trainer.policy.eos_ids = ()
        self.state, self.data_state, self.step_index = trainer.init(), DataState(), 0
        self.setup = time.perf_counter() - t_setup
        self.timer = Timer()
        # The rollout's sampler call, whichever sampler `sampling.engine` picks.
        trainer.policy.sample = self.timer.wrap("sampling", trainer.policy.sample, jax.block_until_ready)
        trainer.ref_logprob_fn = self.timer.wrap("ref_pass", trainer.ref_logprob_fn, jax.block_until_ready)
        # The whole jitted update (mu epochs x minibatches of train_step; one train step at mu = 1); its cache
        # size says whether a call compiled (a new packed row count or completion width).
        self.jitted_update = trainer.update_fn
        trainer.update_fn = self.timer.wrap("train_step", trainer.update_fn, jax.block_until_ready)
        self.key = jax.random.key(config.seed)
        self.quiet_s = quiet_s
        self.records: list[dict] = []
        self.prompt_width = 0
        self.n_params = trainer.policy.model_config.num_params()

    def step(self, warmup: bool) -> None:
        import jax

        trainer = self.trainer
        self.key, sample_key, update_key = jax.random.split(self.key, 3)
        waited = wait_until_quiet(0.0 if warmup else self.quiet_s)
        self.timer.take()
        meter = CpuMeter()
        t0 = time.perf_counter()
        self.step_index += 1
        collected = trainer.collect(self.state, self.data_state, sample_key)
        ro, self.data_state = collected.batch, collected.data_state
        rollout = time.perf_counter() - t0
        collect_parts = self.timer.take()
        padded = self.padded_update(ro, update_key) if PADDED else {}
        self.timer.take()  # the padded update's parts are not the step's
        t1 = time.perf_counter()
        programs = self.jitted_update._cache_size()
        updated = trainer.update(self.state, ro, self.step_index, update_key)
        self.state, metrics = updated.state, {**collected.metrics, **updated.metrics}
        t2 = time.perf_counter()
        parts = {**collect_parts, **self.timer.take()}
        self.prompt_width = int(ro.prompt_tokens.shape[1])
        real = int((np.concatenate([ro.prompt_mask, ro.out.mask], axis=1)[:, :-1] > 0).sum())
        self.records.append(dict(step=rollout + t2 - t1, rollout=rollout, update=t2 - t1,
                                 **parts, train=parts["train_step"],
                                 completion_length=metrics["completion_length/mean"], reward=metrics["reward/mean"],
                                 others=meter.others(), warmup=warmup, real_positions=real,
                                 prompt_length=float(ro.prompt_mask.sum() / len(ro.prompt_mask)),
                                 padding_frac=metrics["update/padding_frac"], **padded,
                                 compiled=self.jitted_update._cache_size() > programs))
        if PADDED:
            r = self.records[-1]
            print(f"    update packed {r['update']:.3f} s (padding {r['padding_frac']:.3f}"
                  f"{', compiled' if r['compiled'] else ''}), padded {r['update_padded']:.3f} s (padding "
                  f"{r['padding_frac_padded']:.3f}{', compiled' if r['padded_compiled'] else ''}) on the same "
                  f"rollout; {real} real positions", flush=True)
        print(f"  ours step {len(self.records)}{' (warm-up)' if warmup else ''}: {rollout + t2 - t1:.3f} s "
              f"(rollout {rollout:.3f}, update {t2 - t1:.3f}), completion length "
              f"{metrics['completion_length/mean']:.1f}, reward {metrics['reward/mean']:.3f}; "
              f"others' CPU {self.records[-1]['others']:.2f} (waited {waited:.0f} s)", flush=True)


    def padded_update(self, ro: Any, key: Any) -> dict[str, float]:
        """The padded update (`rl.packing=false`) of rollout `ro` from a copy of the current state, timed and
        discarded (the state is donated to the update, hence the copy)."""
        import jax
        import jax.numpy as jnp

        trainer = self.trainer
        state = jax.tree.map(jnp.copy, self.state)
        jax.block_until_ready(state)
        trainer.config.rl.packing = False
        programs = self.jitted_update._cache_size()
        try:
            t0 = time.perf_counter()
            updated = trainer.update(state, ro, self.step_index, key)
            jax.block_until_ready(updated.state)
            seconds = time.perf_counter() - t0
        finally:
            trainer.config.rl.packing = True
        return {"update_padded": seconds, "padding_frac_padded": updated.metrics["update/padding_frac"],
                "padded_compiled": self.jitted_update._cache_size() > programs}


# ------------------------------------------------------------------------------------------------ TRL


def run_trl(model_dir: Path, prompts: list[str], out_dir: Path, warmup: int, steps: int, threads: int,
            bf16: bool, remat: bool, quiet_s: float, after_step: Callable[[bool], None]) -> dict:
    """TRL's trainer for `warmup + steps` steps; `after_step(warmup)` runs after each (our step, in turn)."""
    import torch
    import transformers
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import GRPOTrainer

    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    t_setup = time.perf_counter()
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=vowel_reward,
                          args=trl_config(out_dir, warmup + steps, bf16, remat),
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]))
    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)
    setup_s = time.perf_counter() - t_setup
    assert next(trainer.model.parameters()).dtype == torch.float32
    assert trainer.ref_model is not None
    timer = time_trl_parts(trainer)
    records: list[dict] = []
    log_rows: list[dict] = []

    class StepClock(TrainerCallback):
        """Times on_step_begin -> on_step_end: generation, rewards, reference pass, loss, backward, optimizer
        (the batch fetch before and the logging after a step, both tiny here, fall outside)."""

        def on_step_begin(self, *a, **kw):
            self.waited = wait_until_quiet(quiet_s if len(records) >= warmup else 0.0)
            timer.take()
            self.meter = CpuMeter()
            self.start = time.perf_counter()

        def on_step_end(self, *a, **kw):
            step = time.perf_counter() - self.start
            i = len(records)
            parts = timer.take()
            rollout = parts.get("sampling", 0.0) + parts.get("rewards", 0.0)
            update = step - rollout
            records.append(dict(step=step, rollout=rollout, update=update, **parts, others=self.meter.others(),
                                train=update - parts.get("ref_pass", 0.0), warmup=i < warmup))
            print(f"  TRL  step {i + 1}{' (warm-up)' if i < warmup else ''}: {step:.3f} s "
                  f"(rollout {rollout:.3f}, update {update:.3f}); others' CPU {records[-1]['others']:.2f} "
                  f"(waited {self.waited:.0f} s)", flush=True)
            after_step(i < warmup)

        def on_log(self, args, state, control, logs=None, **kw):
            log_rows.append(dict(logs or {}))

    trainer.add_callback(StepClock())
    trainer.train()
    lengths = [row["completions/mean_length"] for row in log_rows if "completions/mean_length" in row]
    rewards = [row["reward"] for row in log_rows if "reward" in row]
    for record, length, reward in zip(records, lengths, rewards, strict=False):
        record.update(completion_length=length, reward=reward)
    return dict(setup=setup_s, records=records, n_params=sum(p.numel() for p in trainer.model.parameters()))


def trl_config(out_dir: Path, max_steps: int, bf16: bool, remat: bool) -> Any:
    """TRL's `GRPOConfig` for the same step as ours (see the module docstring)."""
    import torch
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out_dir), use_cpu=True, bf16=bf16, fp16=False, seed=0,
        per_device_train_batch_size=PROMPTS_PER_STEP * GROUP, num_generations=GROUP, steps_per_generation=1,
        gradient_accumulation_steps=1, num_iterations=1, beta=BETA, max_completion_length=NEW_TOKENS,
        temperature=1.0, top_p=1.0, top_k=0, generation_kwargs={} if VARIED else {"min_new_tokens": NEW_TOKENS},
        loss_type="dapo", scale_rewards="group", epsilon=0.2, learning_rate=LR, lr_scheduler_type="constant",
        adam_beta2=0.99, weight_decay=0.0, max_grad_norm=1.0, max_steps=max_steps, logging_steps=1,
        report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        gradient_checkpointing=remat,  # TRL's default is True; ours is model.remat=false
        model_init_kwargs={"dtype": torch.float32},
    )


def time_trl_parts(trainer: Any) -> Timer:
    """Wrap the TRL trainer's sampling, rewards and log-prob passes (the reference model's apart) in a `Timer`."""
    timer = Timer()
    trainer._generate = timer.wrap("sampling", trainer._generate)
    trainer._calculate_rewards = timer.wrap("rewards", trainer._calculate_rewards)
    logps = trainer._get_per_token_logps_and_entropies

    def per_token_logps(model, *a, **kw):
        name = "ref_pass" if model is trainer.ref_model else "policy_logps"
        return timer.wrap(name, logps)(model, *a, **kw)

    trainer._get_per_token_logps_and_entropies = per_token_logps
    trainer._generate_and_score_completions = timer.wrap("rollout_and_ref", trainer._generate_and_score_completions)
    return timer


# ------------------------------------------------------------------------------------------------ report


CLEAN = 0.1  # a timed step counts when other processes used under this fraction of the CPUs during it


def timed(records: list[dict]) -> list[dict]:
    """The timed steps that ran on a quiet machine (and, ours, whose update compiled nothing), or all timed steps
    when none did."""
    steps = [r for r in records if not r["warmup"]]
    return [r for r in steps if r["others"] < CLEAN and not r.get("compiled")] or steps


def stat(records: list[dict] | None, field: str, how: str) -> float | None:
    """Median or minimum of `field` over the clean timed steps (see `timed`)."""
    if records is None:
        return None
    values = [r.get(field, 0.0) for r in timed(records)]
    if not values:
        return float("nan")
    return statistics.median(values) if how == "median" else min(values)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per side (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps per side (JAX compiles here)")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="every prompt's length, BOS included (default 20; with --model the commonest length)")
    parser.add_argument("--model", default="", help="a HF model directory (default: a random 10M Qwen2)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch.set_num_threads")
    parser.add_argument("--skip-trl", action="store_true", help="run our side only")
    parser.add_argument("--new-tokens", type=int, default=0,
                        help="the completion length limit (default 32, or 128 with --varied)")
    add_switches(parser, {
        "--varied": "8 prompts x 8, up to 128 new tokens, EOS on, lengths that vary; ours packed, and the padded "
                    "update on the same rollouts beside it (needs --model)",
        "--no-padded": "with --varied: skip the padded update beside each packed one (the step comparison alone, in "
                       "about half our side's time)",
        "--bf16": "bfloat16 compute on both sides (ours: model.dtype=bfloat16, float32 params; TRL: bf16=True "
                  "autocast); the matmul baseline is then a bfloat16 one",
        "--remat": "activation checkpointing on both sides (ours: model.remat=true; TRL: gradient_checkpointing=True, "
                   "its default); off on both by default",
    })
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="extra dotted config override for our side, e.g. model.remat=true (repeatable)")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                        help="before each timed step, wait up to S seconds for other processes to leave the CPUs "
                             "idle (on a shared machine)")
    return parser.parse_args()


def print_versions(args: argparse.Namespace) -> None:
    """The libraries' versions and the load; exits when TRL is missing and asked for."""
    import jax
    import torch
    import transformers

    versions = {"jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import trl

        versions["trl"] = trl.__version__
    except ImportError:
        if not args.skip_trl:
            raise SystemExit("TRL is not installed: pip install trl (or pass --skip-trl)") from None
    print(f"python {platform.python_version()}, {os.cpu_count()} CPUs, " + ", ".join(f"{k} {v}"
          for k, v in versions.items()) + f", JAX devices {jax.devices()}", flush=True)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)


def run_sides(args: argparse.Namespace, dtype: str) -> tuple[dict, dict | None, dict, float, float | None]:
    """Our warm-up, then TRL's warm-up and the timed steps of both in turn (or ours alone with `--skip-trl`):
    `(ours, trl or None, model dims, jax matmul FLOP/s, torch matmul FLOP/s or None)`."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir, data, prompts, args.prompt_tokens = build_task(root, args.prompt_tokens, args.model)
        dims = model_dims(model_dir)

        wait_until_quiet(args.wait_quiet)
        print(f"matmul baseline ({dtype} 1024^3, best of 50) ...", flush=True)
        jax_mm = jax_matmul_flops(dtype)
        print(f"  jax.jit matmul: {jax_mm / 1e9:.1f} GFLOP/s", flush=True)

        print(f"ours: {PROMPTS_PER_STEP} prompts x G={GROUP}, {NEW_TOKENS} new tokens, beta={BETA}; warm-up "
              "(the first step compiles)", flush=True)
        overrides = [f"model.remat={str(args.remat).lower()}", *args.override]
        runner = Ours(model_dir, data, root / "ours", args.bf16, args.wait_quiet, overrides, chat=bool(args.model))
        for _ in range(args.warmup):
            runner.step(warmup=True)
        wait_until_quiet(args.wait_quiet)
        jax_mm = max(jax_mm, jax_matmul_flops(dtype))  # again after compiling; the best of both counts
        trl_res, torch_mm = None, None
        if args.skip_trl:
            for _ in range(args.steps):
                runner.step(warmup=False)
        else:
            torch.set_num_threads(args.threads)
            wait_until_quiet(args.wait_quiet)
            torch_mm = torch_matmul_flops(dtype)
            print(f"  torch matmul ({torch.get_num_threads()} threads): {torch_mm / 1e9:.1f} GFLOP/s", flush=True)
            print("TRL warm-up, then TRL and ours in turn, one step each:", flush=True)
            trl_res = run_trl(model_dir, prompts, root / "trl", args.warmup, args.steps, args.threads, args.bf16,
                              args.remat, args.wait_quiet,
                              lambda warmup: None if warmup else runner.step(warmup=False))
        ours = dict(setup=runner.setup, records=runner.records, prompt_width=runner.prompt_width,
                    n_params=runner.n_params)
    return ours, trl_res, dims, jax_mm, torch_mm


def print_overview(args: argparse.Namespace, ours: dict, trl_res: dict | None) -> None:
    """The model, the set-up and warm-up times, and how quiet the machine was during each side's timed steps."""
    o, t = ours["records"], (trl_res["records"] if trl_res else None)
    print()
    print(f"model: {args.model or 'Qwen2-shaped random'}, {ours['n_params'] / 1e6:.2f}M params (ours) / "
          f"{(trl_res or ours)['n_params'] / 1e6:.2f}M (torch), prompts {args.prompt_tokens} tokens "
          f"(ours padded to {ours['prompt_width']}), {PROMPTS_PER_STEP * GROUP} completions x {NEW_TOKENS} tokens "
          f"per step")
    print(f"set-up (load model, build trainer): ours {ours['setup']:.1f} s" +
          (f", TRL {trl_res['setup']:.1f} s" if trl_res else ""))
    print("warm-up steps (ours: include JAX compilation): ours " +
          ", ".join(f"{r['step']:.2f}" for r in o if r["warmup"]) + " s" +
          (", TRL " + ", ".join(f"{r['step']:.2f}" for r in t if r["warmup"]) + " s" if t else ""))
    for name, recs in (("ours", o), ("TRL", t)):
        if recs is None:
            continue
        steps = [r for r in recs if not r["warmup"]]
        clean = [r for r in steps if r["others"] < CLEAN]
        shares = ", ".join(f"{r['others']:.2f}" for r in steps)
        print(f"{name}: {len(clean)} of {len(steps)} timed steps ran with other processes under {CLEAN:.0%} of the "
              f"CPUs (others' share per step: {shares})" +
              ("; statistics below use those steps only" if clean and len(clean) < len(steps) else "") +
              ("; NONE did: the figures below are not trustworthy" if not clean else ""))
    print()


def print_step_table(o: list[dict], t: list[dict] | None) -> None:
    """Seconds per step and per part, median and minimum of each side, and TRL / ours."""
    header = (f"{'seconds per step':<33}{'ours med':>9}{'TRL med':>9}{'ratio':>7}"
              f"{'ours min':>10}{'TRL min':>9}{'ratio':>7}")
    print(header)
    print("-" * len(header))

    def line(label: str, field: str, fmt: str = ".3f") -> None:
        cells = []
        for how in ("median", "min"):
            ov, tv = stat(o, field, how), stat(t, field, how)
            ratio = f"{tv / ov:>7.2f}" if tv is not None and ov else f"{'':>7}"
            cells.append(f"{ov:>{9 if how == 'median' else 10}{fmt}}" + (f"{tv:>9{fmt}}" if tv is not None
                                                                          else f"{'-':>9}") + ratio)
        print(f"{label:<33}" + "".join(cells))

    line("step", "step")
    line("  rollout (sampling + rewards)", "rollout")
    line("    sampling (generate)", "sampling")
    line("  update (ref + train + host)", "update")
    line("    reference log-probs pass", "ref_pass")
    line("    policy fwd+bwd+AdamW", "train")
    line("mean completion length (tokens)", "completion_length", ".1f")
    print()
    if PADDED:
        print_packing(o)


def print_packing(o: list[dict]) -> None:
    """`--varied`: the packed update against the padded one on the same rollouts, step by step (each pair on one
    rollout), over the steps where neither update compiled (else all), then the medians of the per-step figures."""
    steps = [r for r in o if not r["warmup"]]
    quiet = [r for r in steps if not r["compiled"] and not r["padded_compiled"]]
    clean = quiet or steps
    speedups, ideals, of_ideal = [], [], []
    for r in clean:
        # positions computed, padded over packed: real = padded x (1 - its padding) = packed x (1 - its padding)
        ideal = (1.0 - r["padding_frac"]) / (1.0 - r["padding_frac_padded"])
        speedups.append(r["update_padded"] / r["update"])
        ideals.append(ideal)
        of_ideal.append(r["update"] / (r["update_padded"] / ideal))
        print(f"  same rollout: padded {r['update_padded']:.3f} s (padding_frac {r['padding_frac_padded']:.3f}), "
              f"packed {r['update']:.3f} s (padding_frac {r['padding_frac']:.3f}): {speedups[-1]:.2f}x, ideal "
              f"{ideal:.2f}x; real positions/s packed {r['real_positions'] / r['update']:,.0f}, padded "
              f"{r['real_positions'] / r['update_padded']:,.0f}")
    print(f"update on the same rollouts ({len(quiet)} of {len(steps)} steps compiled nothing"
          f"{'' if quiet else ': all used'}; medians): packed "
          f"{statistics.median(speedups):.2f}x faster than padded (median), ideal {statistics.median(ideals):.2f}x; "
          f"packed at {statistics.median(of_ideal):.2f}x its ideal time (target <= 1.1x)")
    print()


def print_flop_rates(args: argparse.Namespace, dtype: str, o: list[dict], t: list[dict] | None, flops: float,
                     o_len: float, jax_mm: float, torch_mm: float | None) -> None:
    """The update's model FLOPs, its FLOP/s over the matmul baselines', and the one-line result."""
    rows = PROMPTS_PER_STEP * GROUP
    print(f"update model FLOPs per step: {flops / 1e9:.2f} GFLOP "
          f"(ref fwd + policy fwd/bwd over {rows} x ({args.prompt_tokens} + {o_len:.0f} - 1) positions)")
    print(f"jitted {dtype} 1024^3 matmul: {jax_mm / 1e9:.1f} GFLOP/s" +
          (f"; torch.mm ({args.threads} threads): {torch_mm / 1e9:.1f} GFLOP/s" if t else ""))
    for how in ("median", "min"):
        o_compute = stat(o, "ref_pass", how) + stat(o, "train", how)
        text = (f"update FLOP/s / matmul FLOP/s ({how}): ours {flops / o_compute / jax_mm:.3f} "
                f"(ref pass + train step, {flops / o_compute / 1e9:.1f} GFLOP/s), "
                f"ours {flops / stat(o, 'update', how) / jax_mm:.3f} (whole trainer.update)")
        if t:
            t_update = stat(t, "update", how)
            text += (f"; TRL {flops / t_update / jax_mm:.3f} of the JAX matmul, "
                     f"{flops / t_update / torch_mm:.3f} of torch's")
        print(text)
    if t:
        o_compute = stat(o, "ref_pass", "median") + stat(o, "train", "median")
        print(f"\nRESULT: ours {stat(o, 'step', 'median'):.3f} s/step, TRL {stat(t, 'step', 'median'):.3f} s/step "
              f"(medians): TRL/ours = {stat(t, 'step', 'median') / stat(o, 'step', 'median'):.2f}x "
              f"(best steps: {stat(t, 'step', 'min') / stat(o, 'step', 'min'):.2f}x; target >= 2x); "
              f"ours update at {flops / o_compute / jax_mm:.3f} of the jitted matmul's FLOP/s" +
              ("" if all(r["others"] < CLEAN for r in timed(o) + timed(t)) else
               " [NOT TRUSTWORTHY: other processes used the CPUs during these steps]"))


def main() -> None:
    args = parse_args()
    if args.varied:
        if not args.model:
            raise SystemExit("--varied needs --model DIR (a chat model, e.g. SmolLM2-135M-Instruct)")
        use_varied_shape()
    global PADDED
    PADDED = args.varied and not args.no_padded
    if args.new_tokens:
        global NEW_TOKENS
        NEW_TOKENS = args.new_tokens
    dtype = "bfloat16" if args.bf16 else "float32"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's jaxrl_llm, installed or not
    print_versions(args)
    ours, trl_res, dims, jax_mm, torch_mm = run_sides(args, dtype)
    o, t = ours["records"], (trl_res["records"] if trl_res else None)
    o_len = stat(o, "completion_length", "median")
    if VARIED:  # prompts of their own lengths: the mean
        args.prompt_tokens = round(stat(o, "prompt_length", "median"))
    flops = update_flops(dims, PROMPTS_PER_STEP * GROUP, args.prompt_tokens, o_len)
    print_overview(args, ours, trl_res)
    print_step_table(o, t)
    print_flop_rates(args, dtype, o, t, flops, o_len, jax_mm, torch_mm)
    sys.stdout.flush()


if __name__ == "__main__":
    main()

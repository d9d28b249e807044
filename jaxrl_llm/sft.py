"""Supervised fine-tuning (`--algo sft`): cross-entropy on answer tokens, from a HF model or from scratch.

This is how the default task's base model is made: `python train.py --algo sft --config
configs/sft_arithmetic.yaml` trains a small Llama from random weights on the arithmetic task for a fixed,
deliberately short budget, so its greedy held-out accuracy is well below 100% and RL has room to improve it.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxrl_llm.checkpoint import Checkpointer
from jaxrl_llm.config import ConfigError, RunConfig
from jaxrl_llm.data import (
    DataState,
    PromptSet,
    bucket,
    build_prompt_set,
    eos_token_ids,
    left_pad,
    load_records,
    load_tokenizer,
    next_batch_indices,
)
from jaxrl_llm.evaluation import evaluate_greedy
from jaxrl_llm.logging import RunLogger, write_summary
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import Params, init_params
from jaxrl_llm.models.hf import config_from_hf, load_hf_model, resolve_model_dir, save_hf_model
from jaxrl_llm.rewards import resolve_reward
from jaxrl_llm.run_dir import open_run_dir
from jaxrl_llm.sampling import SamplingConfig
from jaxrl_llm.sharding import (
    MeshShape,
    batch_divisor,
    global_array,
    init_optimizer_state,
    make_mesh,
    param_shardings,
    to_host,
)
from jaxrl_llm.train_step import (
    PolicyBatch,
    PolicyLossConfig,
    make_optimizer,
    make_train_step,
    master_weights,
    sft_loss,
)


def _tokenizer_for_scratch(spec: str, out_dir: Path) -> tuple[Any, Path]:
    """The tokenizer of a from-scratch model, saved under `out_dir/tokenizer` so exports carry it."""
    target = out_dir / "tokenizer"
    if not spec:
        raise ValueError("model.init is set (train from scratch) but model.tokenizer is empty")
    if jax.process_index() == 0:  # one writer; the others wait for the files below
        if spec == "arithmetic":
            from jaxrl_llm.tasks.arithmetic import make_tokenizer

            make_tokenizer().save_pretrained(target)
        else:
            load_tokenizer(spec).save_pretrained(target)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("jaxrl_llm: scratch tokenizer written")
    return load_tokenizer(target), target


def initial_model(c: RunConfig, out_dir: Path) -> tuple[ModelConfig, Params, Any, Path]:
    """`(model_config, params, tokenizer, tokenizer_dir)`: random init from `model.init`, else `model.path`."""
    overrides = dict(dtype=c.model.dtype, param_dtype=c.model.param_dtype, remat=c.model.remat,
                     attention_query_chunk=c.model.attention_query_chunk)
    if c.model.init:
        tokenizer, tok_dir = _tokenizer_for_scratch(c.model.tokenizer, out_dir)
        hf = {"vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
              "eos_token_id": tokenizer.eos_token_id, **dict(c.model.init)}
        model_config = config_from_hf(hf, **overrides)
        return model_config, master_weights(init_params(model_config, jax.random.key(c.seed))), tokenizer, tok_dir
    model_dir = resolve_model_dir(c.model.path)
    model_config, params = load_hf_model(model_dir, **overrides)
    return model_config, master_weights(params), load_tokenizer(model_dir), model_dir


def completion_arrays(prompt_set: PromptSet, indices: np.ndarray, tokenizer: Any, answer_field: str,
                      eos_id: int, pad_id: int) -> tuple[np.ndarray, ...]:
    """Left-padded prompts and right-padded `answer + EOS` targets `[B, P]`, `[B, T]` (bucketed widths)."""
    prompts = [prompt_set.token_ids[i] for i in indices]
    answers = [tokenizer(str(prompt_set.records[i][answer_field]), add_special_tokens=False)["input_ids"] + [eos_id]
               for i in indices]
    pt, pm = left_pad(prompts, bucket(max(map(len, prompts))), pad_id)
    width = bucket(max(map(len, answers)), 8)
    ct = np.full((len(answers), width), pad_id, np.int32)
    cm = np.zeros((len(answers), width), np.int32)
    for row, ids in enumerate(answers):
        ct[row, : len(ids)] = ids
        cm[row, : len(ids)] = 1
    return pt, pm, ct, cm


def train_sft(c: RunConfig, *, resume: bool = False, overwrite: bool = False,
              allow_config_change: bool = False) -> dict[str, Any]:
    """Run SFT in `c.out_dir` (claimed by `run_dir.open_run_dir`); `resume` continues from its checkpoint."""
    export_dir = Path(c.export_dir or Path(c.out_dir) / "hf")
    run_dir = open_run_dir(c, resume=resume, overwrite=overwrite, allow_config_change=allow_config_change,
                           export_dir=export_dir if c.export else None,
                           input_dirs=() if c.model.init else (c.model.path,))
    try:
        return _train_sft(c, export_dir, resume)
    finally:
        run_dir.release()


def _train_sft(c: RunConfig, export_dir: Path, resume: bool) -> dict[str, Any]:
    out_dir = Path(c.out_dir)
    model_config, params, tokenizer, tok_dir = initial_model(c, out_dir)
    train = build_prompt_set(*load_records(c.data.train, c.data.split), c.data, tokenizer)
    evals = build_prompt_set(*load_records(c.data.eval, c.data.eval_split), c.data, tokenizer) if c.data.eval else None
    eos = eos_token_ids(tok_dir, tokenizer)
    pad_id = int(tokenizer.pad_token_id)
    reward = ((c.eval_reward, resolve_reward(c.eval_reward)) if c.eval_reward else
              (c.rewards[0].name, resolve_reward(c.rewards[0].name, dict(c.rewards[0].kwargs))))
    greedy = SamplingConfig(max_new_tokens=c.sampling.max_new_tokens, greedy=True, eos_ids=eos, pad_id=pad_id,
                            prompt_bucket=c.sampling.prompt_bucket, new_tokens_bucket=c.sampling.new_tokens_bucket)

    mesh = make_mesh(MeshShape(c.mesh.data, c.mesh.fsdp, c.mesh.tensor))
    if c.sft.batch_size % batch_divisor(mesh):
        raise ConfigError(f"sft.batch_size={c.sft.batch_size} must be divisible by mesh.data * mesh.fsdp "
                         f"({batch_divisor(mesh)}) for the data-parallel step")
    params_sharding = param_shardings(params, mesh)
    params = jax.device_put(params, params_sharding)
    optimizer, schedule = make_optimizer(c.optim, max(c.steps, 1))
    opt_state = init_optimizer_state(optimizer, params, params_sharding, mesh)
    step_fn = make_train_step(mesh, loss_fn=sft_loss, model_config=model_config,
                              loss_config=PolicyLossConfig(logprob_block_mib=c.model.logprob_block_mib),
                              optimizer=optimizer, params_sharding=params_sharding,
                              opt_state_sharding=jax.tree.map(lambda x: x.sharding, opt_state))
    checkpointer = Checkpointer(out_dir / "checkpoints", keep=c.keep_checkpoints)
    first_step, state = 1, DataState()
    if resume:
        (params, opt_state), meta = checkpointer.restore_latest((params, opt_state))
        first_step, state = int(meta["step"]) + 1, DataState(**meta["data_state"])

    def evaluate() -> dict[str, float]:
        if evals is None:
            return {}
        return evaluate_greedy(params, model_config, tokenizer, evals, reward, greedy,
                               batch_size=c.sft.eval_batch_size, limit=c.eval_size or None, mesh=mesh)

    logger = RunLogger(out_dir, total_steps=c.steps, initial_step=first_step - 1, tensorboard=c.tensorboard,
                       progress_bar=c.progress_bar, desc="sft", resume_step=first_step - 1 if resume else None)
    logger.message(f"SFT of a {model_config.num_params() / 1e6:.2f}M-parameter {model_config.model_type} "
                   f"on {len(train)} examples")
    summary: dict[str, Any] = {}
    try:
        for step in range(first_step, c.steps + 1):
            t0 = time.perf_counter()
            indices, state = next_batch_indices(len(train), c.sft.batch_size, state, c.seed, c.data.shuffle)
            pt, pm, ct, cm = completion_arrays(train, indices, tokenizer, c.data.answer_field, eos[0], pad_id)
            zeros = np.zeros(ct.shape, np.float32)
            batch = PolicyBatch(pt, pm, ct, cm, zeros, zeros, np.zeros(len(pt), np.float32))
            batch = jax.tree.map(lambda x: global_array(x, mesh), batch)
            params, opt_state, metrics = step_fn(params, opt_state, batch)
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            metrics.update({"learning_rate": float(schedule(step - 1)), "time/step": time.perf_counter() - t0})
            if (c.eval_every and step % c.eval_every == 0) or step == c.steps:
                metrics.update(evaluate())
                if "eval/accuracy" in metrics:
                    logger.message(f"step {step}: loss {metrics['sft_loss']:.4f}, "
                                   f"held-out accuracy {metrics['eval/accuracy']:.3f}")
                if step == c.steps:
                    summary["after"] = {k: v for k, v in metrics.items() if k.startswith("eval/")}
            if step % c.log_every == 0 or step == c.steps:
                logger.log(step, metrics)
            logger.progress({"loss": metrics["sft_loss"]})
            if c.checkpoint_every and (step % c.checkpoint_every == 0 or step == c.steps):
                checkpointer.save(step, (params, opt_state), {"step": step, "data_state": dataclasses.asdict(state)})
    finally:
        checkpointer.close()
        logger.close()
    if "after" not in summary:  # no step ran (steps reached already)
        summary["after"] = evaluate()
    if c.export:
        host_params = to_host(params)
        if jax.process_index() == 0:
            summary["export"] = str(save_hf_model(host_params, model_config, export_dir, tokenizer_dir=tok_dir,
                                                  dtype=model_config.param_dtype))
    write_summary(out_dir, summary)
    return summary

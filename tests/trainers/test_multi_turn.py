"""Multi-turn rollouts: the update trains on exactly the sampled tokens, the loss mask is exactly the model's
positions, a one-turn environment is today's single-turn step bit for bit, and tools answer with observations."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxrl_llm.envs.rendering as rendering
import jaxrl_llm.trainers.trajectories as trajectories
from jaxrl_llm.data import DataState, encode_text
from jaxrl_llm.envs.base import StepResult
from jaxrl_llm.envs.tool_formats import TOOL_FORMATS
from jaxrl_llm.envs.tools import CALCULATOR, Tool, ToolCall, call_tool
from jaxrl_llm.models.tokenizer import load_tokenizer
from jaxrl_llm.trainers import make_trainer
from tests.runs import ROOT, read_rows, read_samples, tiny_run, tiny_run_args

pytestmark = pytest.mark.heavy(seconds=33)

# Text the environment says that a tokenizer splits differently alone and after the model's text.
REPLY = "ok: 7+1=8?"


class ChattyEnvironment:
    """Answers every turn with REPLY for `turns - 1` turns, then ends: the model's text does not matter."""

    def __init__(self, record: dict, *, turns: int = 3, **unused: object) -> None:
        self.record, self.turns, self.seen = record, turns, 0

    def reset(self) -> list[dict]:
        return [{"role": "user", "content": self.record["prompt"]}]

    def step(self, text: str) -> StepResult:
        self.seen += 1
        done = self.seen >= self.turns
        return StepResult([] if done else [{"role": "user", "content": REPLY}], 0.25, done, {})


def chatty(record: dict, **kwargs: object) -> ChattyEnvironment:
    return ChattyEnvironment(record, **kwargs)


HUGE = "x" * 2_000_000  # a 2 MB reply


class HugeEnvironment(ChattyEnvironment):
    """Replies to the first turn with 2 MB of text (far past any token budget), then with REPLY."""

    def step(self, text: str) -> StepResult:
        result = super().step(text)
        if self.seen == 1:
            return StepResult([{"role": "tool", "content": HUGE}], 0.0, False, {})
        return result


def huge(record: dict, **kwargs: object) -> HugeEnvironment:
    return HugeEnvironment(record, **kwargs)


class BrokenEnvironment(ChattyEnvironment):
    """Every fourth one hangs at its start; the others raise on odd rows' first step and hang on the others' (past
    env.timeout_s)."""

    started = itertools.count()

    def reset(self) -> list[dict]:
        if next(self.started) % 4 == 0:
            time.sleep(3.0)
        return super().reset()

    def step(self, text: str) -> StepResult:
        if int(self.record["prompt"].split("+")[0]) % 2:
            raise RuntimeError("the game crashed")
        time.sleep(3.0)
        return super().step(text)


def broken(record: dict, **kwargs: object) -> BrokenEnvironment:
    return BrokenEnvironment(record, **kwargs)


def _chat_task(tmp_path: Path) -> Path:
    rows = [{"prompt": f"What is {a} + {b}? Reply with the number.", "answer": str(a + b)}
            for a in range(8) for b in range(3)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path / "chat.jsonl"


def test_a_one_turn_environment_is_the_single_turn_step_bit_for_bit(tiny_task, tmp_path):
    # no warmup: the first update moves the weights (a zero step would make any two updates equal)
    # a reward that varies within groups (completion length), so the update has something to learn from
    rewards = [{"name": "tests.runs:completion_length"}]
    single = make_trainer(tiny_run("grpo_arithmetic", tmp_path / "single", "data.eval=", "optim.warmup_steps=0",
                                   task=tiny_task, rewards=rewards))
    multi = make_trainer(tiny_run("grpo_arithmetic", tmp_path / "multi", "data.eval=", "optim.warmup_steps=0",
                                  "env.name=single_turn", task=tiny_task, rewards=rewards))
    collect_key, update_key = jax.random.split(jax.random.key(7))
    a = single.algorithm.collect(single.state, DataState(), collect_key)
    b = multi.algorithm.collect(multi.state, DataState(), collect_key)
    for field in ("tokens", "mask", "logprobs", "logprobs_untruncated", "lengths", "stopped_on_eos"):
        np.testing.assert_array_equal(np.asarray(getattr(a.batch.out, field)), np.asarray(getattr(b.batch.out, field)))
    np.testing.assert_array_equal(a.batch.rewards, b.batch.rewards)
    np.testing.assert_array_equal(b.batch.loss_mask, np.asarray(a.batch.out.mask))  # one turn: all the model's
    assert a.batch.completions == b.batch.completions and a.tokens == b.tokens
    initial = [np.asarray(x) for x in jax.tree.leaves(single.state["params"])]
    ua = single.algorithm.update(single.state, a.batch, 1, update_key)
    ub = multi.algorithm.update(multi.state, b.batch, 1, update_key)
    assert any(not np.array_equal(x, np.asarray(y)) for x, y in zip(initial, jax.tree.leaves(ua.state["params"]),
                                                                     strict=True))
    for x, y in zip(jax.tree.leaves(ua.state["params"]), jax.tree.leaves(ub.state["params"]), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert {k: ua.metrics[k] for k in ua.metrics} == {k: ub.metrics[k] for k in ua.metrics}
    assert b.metrics["turns/mean"] == 1.0 and b.metrics["masked_tokens/frac"] == 0.0


@pytest.mark.parametrize("engine", ["static", "paged"])
def test_the_update_trains_on_the_sampled_tokens_and_the_loss_mask_is_the_models(tiny_chat_model, tmp_path,
                                                                                  monkeypatch, engine):
    """Each turn's tokens are the sampler's, unchanged, whatever the environment prints; the environment's are the
    template's rendering; the mask is 1 exactly on the sampled ones; the update gets these arrays. The same through
    the rollout engine, whose conversations continue from their pages (no page is left held)."""
    turns: list[tuple[list[int], np.ndarray, np.ndarray]] = []  # (rows, tokens, mask) of each sampled turn
    take_turn = trajectories.TrajectoryCollector._take_turn

    def spy(self, episodes, rows, out):
        turns.append((list(rows), np.asarray(out.tokens), np.asarray(out.mask, bool)))
        return take_turn(self, episodes, rows, out)

    monkeypatch.setattr(trajectories.TrajectoryCollector, "_take_turn", spy)
    config = tiny_run(None, tmp_path / "run", f"model.path={tiny_chat_model}", f"data.train={_chat_task(tmp_path)}",
                      "data.eval=", "data.chat_template=true", "sampling.max_new_tokens=6", "env.max_tokens=200",
                      "env.name=tests.trainers.test_multi_turn:chatty", "rl.prompts_per_step=2", "rl.group_size=2",
                      f"sampling.engine={engine}", rewards=[{"name": "math_answer"}])
    trainer = make_trainer(config)
    for seed in range(20):  # the random model must end a turn on EOS for the episode to go on: the first key that does
        turns.clear()
        ro = trainer.algorithm.collect(trainer.state, DataState(), jax.random.key(seed)).batch
        if len(turns) > 1:
            break
    if engine == "paged":
        pool = trainer.algorithm.policy.engine.allocator
        assert pool.in_use() == 0 and pool.reserved == 0
    tokenizer = load_tokenizer(tiny_chat_model)
    reply = encode_text(tokenizer, rendering.followup_text(tokenizer, [{"role": "user", "content": REPLY}],
                                                              chat=True), add_special_tokens=False)
    expected = {r: ([], []) for r in range(len(ro.completions))}  # tokens, loss mask
    retokenized_differs = False
    for turn, (rows, tokens, mask) in enumerate(turns):
        for i, r in enumerate(rows):
            ids = tokens[i][mask[i]].tolist()
            if turn > 0:  # the row went on: the environment's reply came first
                expected[r][0].extend(reply)
                expected[r][1].extend([0] * len(reply))
            expected[r][0].extend(ids)
            expected[r][1].extend([1] * len(ids))
            text = tokenizer.decode(ids, skip_special_tokens=True)
            retokenized_differs |= encode_text(tokenizer, text, add_special_tokens=False) != ids
    assert len(turns) > 1
    width = ro.out.tokens.shape[1]
    for r, (ids, loss) in expected.items():
        assert np.asarray(ro.out.tokens)[r, : len(ids)].tolist() == ids, r
        assert np.asarray(ro.loss_mask)[r].tolist() == loss + [0] * (width - len(ids)), r
        assert int(np.asarray(ro.out.mask)[r].sum()) == len(ids)
    assert retokenized_differs  # decoding and re-encoding the model's text would have changed its tokens
    seen = {}
    update_fn = trainer.algorithm.update_fn

    def spy_update(state, batch, *rest):
        s = batch.sequences
        seen["tokens"], seen["loss_mask"] = np.asarray(s.completion_tokens), np.asarray(s.loss_mask)
        seen["attention"] = np.asarray(s.completion_mask)
        return update_fn(state, batch, *rest)

    trainer.algorithm.update_fn = spy_update
    trainer.algorithm.update(trainer.state, ro, 1, jax.random.key(1))
    np.testing.assert_array_equal(seen["tokens"], np.asarray(ro.out.tokens))
    np.testing.assert_array_equal(seen["loss_mask"], np.asarray(ro.loss_mask))
    np.testing.assert_array_equal(seen["attention"], np.asarray(ro.out.mask))
    assert 0 < np.asarray(ro.loss_mask).sum() < np.asarray(ro.out.mask).sum()  # both kinds of tokens present


def test_an_environment_that_raises_or_hangs_ends_its_episode_not_the_run(tiny_task, tmp_path):
    config = tiny_run("grpo_arithmetic", tmp_path / "run", "data.eval=",
                      "env.name=tests.trainers.test_multi_turn:broken",
                      "env.timeout_s=0.5", "steps=1", task=tiny_task)
    trainer = make_trainer(config)
    collected = trainer.algorithm.collect(trainer.state, DataState(), jax.random.key(0))
    assert collected.metrics["env_errors/frac"] == 1.0  # every episode ended on its environment's fault
    assert (collected.batch.episode_stats["turns"] == 1).all()
    errors = {ep_error for ep_error in collected.batch.episode_stats["env_error_messages"]}
    assert any("raised RuntimeError: the game crashed" in e for e in errors)
    assert any("environment took longer than env.timeout_s=0.5 s" in e for e in errors), errors  # hung steps abandoned
    assert any("reset took longer than env.timeout_s=0.5 s" in e for e in errors)  # and hung starts
    assert collected.metrics["time/env"] < 0.5 * 2 + 2.0  # one deadline to start, one to step: not the 3 s hangs


HUNG_ENVIRONMENT = """
import time

from jaxrl_llm.envs.base import StepResult


class Hung:
    def __init__(self, record, **kwargs):
        self.record = record

    def reset(self):
        return [{"role": "user", "content": self.record["prompt"]}]

    def step(self, text):
        time.sleep(600)  # far past env.timeout_s, and past the test's own timeout
        return StepResult([], 1.0, True)


def hung(record, **kwargs):
    return Hung(record)
"""


def test_a_run_whose_environment_hangs_every_step_pays_the_deadline_and_exits_at_once(tiny_task, tmp_path):
    (tmp_path / "hung_env.py").write_text(HUNG_ENVIRONMENT)
    out = tmp_path / "run"
    args = tiny_run_args(out, "data.eval=", "env.name=hung_env:hung", "env.timeout_s=1", "env.workers=2",
                         "steps=3", "rewards=[]", task=tiny_task)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "--algo", "grpo", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=400)
    ended = time.time()
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_rows(out, "reward/mean")
    assert len(rows) == 3 and all(row["env_errors/frac"] == 1.0 and row["reward/mean"] == 0.0 for row in rows)
    # Each step waits for its environment steps until env.timeout_s, then goes on: 2 workers each hold a hung call
    # per step (6 by the end) and the other 14 episodes' steps are cancelled at the deadline, not queued behind them.
    assert all(1.0 <= row["time/env"] < 1.0 + 10 for row in rows), [row["time/env"] for row in rows]
    assert rows[-1]["time/step"] < 1.0 + 30  # the deadline and the tiny model's own work, not the 600 s hang
    last_write = max(path.stat().st_mtime for path in out.rglob("*") if path.is_file())
    assert ended - last_write < 30  # the process did not wait for its 6 hung calls to end


def test_a_huge_reply_ends_the_episode_without_being_rendered_or_tokenized(tiny_task, tmp_path, monkeypatch):
    """An environment answering with 2 MB: its length alone says it cannot fit the episode's token budget, so the
    episode ends there (as a rendered and counted reply past the budget would end it) and the text never reaches the
    chat template or the tokenizer (both took minutes on such a reply)."""
    import jaxrl_llm.trainers.trajectories as trajectories

    rendered: list[int] = []
    render = trajectories.followup_text

    def spy(tokenizer, messages, **kwargs):  # noqa: ANN001, ANN003, ANN202
        rendered.append(sum(len(m["content"]) for m in messages))
        return render(tokenizer, messages, **kwargs)

    monkeypatch.setattr(trajectories, "followup_text", spy)
    out = tmp_path / "run"
    config = tiny_run("grpo_arithmetic", out, "data.eval=", "env.name=tests.trainers.test_multi_turn:huge",
                      "env.max_tokens=64",
                      "steps=1", task=tiny_task)
    make_trainer(config).run()
    (row,) = read_rows(out, "reward/mean")
    assert row["turns/mean"] == 1.0  # every episode ended at the huge reply
    assert rendered == []  # and no reply was rendered: each first step's reply was the huge one


def test_a_tool_run_logs_turns_and_shows_conversations(tiny_task, tmp_path):
    out = tmp_path / "run"
    config = tiny_run("grpo_arithmetic", out, "data.eval=", "env.name=tests.trainers.test_multi_turn:chatty",
                      "env.max_tokens=64",
                      "steps=2", "sample_every=1", task=tiny_task)
    make_trainer(config).run()
    rows = read_rows(out, "reward/mean")
    assert len(rows) == 2
    for row in rows:
        assert 1.0 <= row["turns/mean"] <= 3.0 and 0.0 < row["masked_tokens/frac"] < 1.0
        assert row["time/env"] >= 0.0 and row["tool_calls/mean"] == 0.0
    sample = read_samples(out)[0]
    roles = [m["role"] for m in sample["conversation"]]
    assert roles[0] == "user" and roles[1] == "assistant"
    assert all(m["content"] == REPLY for m in sample["conversation"][2::2])
    from jaxrl_llm.cli.report import PLOTS, completion_html, expand_keys, load_run

    _, _, left, right = PLOTS["turns"]
    assert expand_keys(left + right, load_run(out)["metrics"])  # the report's turns plot has its metrics
    page = completion_html(sample)
    assert page.count("class='model'") == roles.count("assistant") and page.count("class='env'") == len(roles) - 1 \
        - roles.count("assistant")


def test_tool_calls_are_parsed_and_bad_ones_answered_with_an_error():
    calls, errors = TOOL_FORMATS["hermes"].parse('x <tool_call>{"name": "calculator", "arguments": {"expression": '
                                                 '"2*3"}}</tool_call> <tool_call>{not json}</tool_call>', None)
    assert calls == [ToolCall("calculator", {"expression": "2*3"})] and len(errors) == 1
    tools = {"calculator": CALCULATOR}
    assert call_tool(tools, calls[0]) == ("6", True)
    assert call_tool(tools, ToolCall("search", {}))[1] is False
    assert "takes expression" in call_tool(tools, ToolCall("calculator", {"expr": "1"}))[0]
    assert call_tool(tools, ToolCall("calculator", {"expression": "1/0"}))[0].startswith("error:")

    def slow(seconds: str) -> str:
        time.sleep(float(seconds))
        return "late"

    sleeper = Tool("sleep", "sleeps", {"type": "object", "properties": {"seconds": {"type": "string"}},
                                       "required": ["seconds"]}, slow, timeout_s=0.2)
    start = time.perf_counter()
    observation, ok = call_tool({"sleep": sleeper}, ToolCall("sleep", {"seconds": "5"}))
    assert not ok and "longer than" in observation and time.perf_counter() - start < 4


def test_followup_text_is_what_the_chat_template_renders_after_the_models_turn(tiny_chat_model):
    tokenizer = load_tokenizer(tiny_chat_model)
    messages = [{"role": "tool", "content": "42"}]
    text = rendering.followup_text(tokenizer, messages, chat=True)
    assert text == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    whole = tokenizer.apply_chat_template(conversation + messages, tokenize=False, add_generation_prompt=True)
    assert whole.endswith("a<|im_end|>" + text)
    assert rendering.followup_text(None, messages, chat=False) == "\n<tool_response>\n42\n</tool_response>\n"


@pytest.mark.parametrize("name", ["tool_use", "single_turn"])
def test_the_built_in_environments_open_with_the_records_prompt(name):
    from jaxrl_llm.envs.base import resolve_environment

    env = resolve_environment(name)({"prompt": "2+2=", "answer": "4"}, tools=[CALCULATOR])
    assert env.reset() == [{"role": "user", "content": "2+2="}]
    done = env.step("4")
    assert done.done and done.messages == []
    if name == "tool_use":
        result = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "12*12"}}</tool_call>')
        assert not result.done and result.messages == [{"role": "tool", "name": "calculator", "content": "144"}]
        assert result.info == {"tool_calls": 1, "tool_errors": 0}


def test_eval_plays_the_environment_and_writes_whole_conversations(tiny_task, tmp_path):
    import sys

    from jaxrl_llm.cli.eval import main

    out = tmp_path / "eval"
    assert main(["--model", str(tiny_task / "model"), "--data", str(tiny_task / "test.jsonl"), "--reward",
                 "math_answer", "--env", "tests.trainers.test_multi_turn:chatty", "--max-turns", "2",
                 "--max-new-tokens", "6",
                 "--limit", "4", "--out", str(out)]) == 0
    result = json.loads((out / "eval.json").read_text())
    assert result["settings"]["env"] == "tests.trainers.test_multi_turn:chatty" and result["metrics"]["prompts"] == 4.0
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and sys.modules["tests.trainers.test_multi_turn"]
    for row in rows:
        roles = [m["role"] for m in row["conversation"]]
        assert roles[:2] == ["user", "assistant"] and row["turns"] == roles.count("assistant") <= 2
        assert row["completion"] == row["conversation"][-1]["content"] or roles[-1] != "assistant"
    assert result["metrics"]["turns"] == np.mean([r["turns"] for r in rows])


class RewardingEnvironment(ChattyEnvironment):
    """Rewards its first turn with 1 (whatever the model says), the later ones with 0, over 3 turns."""

    def step(self, text: str) -> StepResult:
        result = super().step(text)
        return result._replace(reward=1.0 if self.seen == 1 else 0.0)


def rewarding(record: dict, **kwargs: object) -> RewardingEnvironment:
    return RewardingEnvironment(record, **kwargs)


def test_turn_level_advantages_give_each_turn_its_return_still_to_come():
    import jax.numpy as jnp

    from jaxrl_llm.rl.advantages import group_normalized_advantages, turn_level_advantages

    rewards = jnp.array([2.0, 1.0, 0.0, 1.0])  # one group of 4 whole returns G_1
    outcome = group_normalized_advantages(rewards, group_size=4)
    credit = jnp.array([[0.0, 0.0, -1.0, -1.0], [0.0, -1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, -1.0, -1.0, 0.0]])
    got = np.asarray(turn_level_advantages(jnp.repeat(outcome[:, None], 4, axis=1), credit, rewards, group_size=4))
    std = float(np.std([2.0, 1.0, 0.0, 1.0], ddof=1))
    for i in range(4):
        for t in range(4):
            g_k = float(rewards[i] + credit[i, t])  # the return from this token's turn on
            assert got[i, t] == pytest.approx((g_k - 1.0) / (std + 1e-6), rel=1e-5)
    none = np.asarray(turn_level_advantages(jnp.zeros((4, 4)), credit, rewards, group_size=4, scale="none"))
    np.testing.assert_allclose(none, np.asarray(credit))
    tied = np.asarray(turn_level_advantages(jnp.zeros((4, 4)), credit, jnp.ones(4), group_size=4))
    np.testing.assert_allclose(tied, np.asarray(credit))  # equal returns: the credit is not divided by a zero std


def test_an_environment_that_rewards_turns_credits_each_turn_with_what_comes_after(tiny_task, tmp_path):
    config = tiny_run("grpo_arithmetic", tmp_path / "run", "data.eval=",
                      "env.name=tests.trainers.test_multi_turn:rewarding",
                      "env.max_tokens=200", task=tiny_task)
    trainer = make_trainer(config)
    ro = trainer.algorithm.collect(trainer.state, DataState(), jax.random.key(0)).batch
    assert ro.turn_credit is not None
    loss_mask, credit = np.asarray(ro.loss_mask, bool), ro.turn_credit
    for r in range(len(ro.completions)):
        turns = ro.episode_stats["turns"][r]
        values = credit[r][loss_mask[r]]
        assert set(np.unique(values)) <= {0.0, -1.0} and (values[0] == 0.0)  # turn 1 keeps its whole return
        assert (values == -1.0).any() == (turns > 1)  # later turns do not get turn 1's reward
        assert (credit[r][~loss_mask[r]] == 0).all()
    trainer.algorithm.update(trainer.state, ro, 1, jax.random.key(1))  # the update takes the credit


@pytest.mark.parametrize("algo", ["rloo", "reinforce_pp"])
def test_every_grpo_family_algorithm_trains_on_trajectories(tiny_task, tmp_path, algo):
    config = tiny_run("grpo_arithmetic", tmp_path / algo, "data.eval=",
                      "env.name=tests.trainers.test_multi_turn:rewarding",
                      "env.max_tokens=64", f"algo={algo}", "rl.beta=0.04", "optim.warmup_steps=0", task=tiny_task)
    trainer = make_trainer(config)
    collected = trainer.algorithm.collect(trainer.state, DataState(), jax.random.key(0))
    before = [np.asarray(x) for x in jax.tree.leaves(trainer.state["params"])]  # the update donates the state
    updated = trainer.algorithm.update(trainer.state, collected.batch, 1, jax.random.key(1))
    assert collected.metrics["turns/mean"] > 1 and np.isfinite(updated.metrics["policy_loss"])
    after = jax.tree.leaves(updated.state["params"])
    assert any(not np.array_equal(a, np.asarray(b)) for a, b in zip(before, after, strict=True))


def test_ppo_refuses_an_environment_in_one_line():
    from jaxrl_llm.errors import ConfigError
    from jaxrl_llm.preflight import load_config

    with pytest.raises(ConfigError, match="env.name=tool_use with algo=ppo"):
        load_config(None, ["algo=ppo", "env.name=tool_use"])


def test_a_template_that_renders_tools_gets_their_schemas(tiny_chat_model):
    from jaxrl_llm.config import DataSection
    from jaxrl_llm.data import render_prompt
    from jaxrl_llm.envs.rendering import declare_tools

    tokenizer = load_tokenizer(tiny_chat_model)
    plain = DataSection(chat_template=True)
    schemas, data = declare_tools([CALCULATOR], plain, tokenizer)  # ChatML here: no tool format
    assert schemas is None and data.system_prompt.startswith("You can use tools.")
    tokenizer.chat_template = ("{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t.function.name }} "
                               "{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
                               "{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    schemas, data = declare_tools([CALCULATOR], plain, tokenizer)
    assert schemas == [CALCULATOR.schema] and data.system_prompt == ""
    text, _ = render_prompt("What is 2 * 3?", data, tokenizer, "test", schemas)
    assert text.startswith("<|im_start|>system\nTools: calculator ")


def test_a_run_that_executes_model_code_says_where_at_its_start(tiny_task, tmp_path):
    from jaxrl_llm.envs.sandbox import bwrap_makes_views, bwrap_usable, sandbox_problem
    from jaxrl_llm.preflight import check_sandbox

    config = tiny_run("grpo_arithmetic", tmp_path / "run", "data.eval=", "env.name=tool_use",
                      "env.tools=[calculator,python]", task=tiny_task)
    makes_views, why = bwrap_makes_views()
    if not makes_views:  # skipped only without bubblewrap or user namespaces; a broken sandbox fails
        pytest.skip(f"{why}: the run refuses to start (tests/envs/test_sandbox.py)")
    assert bwrap_usable(), sandbox_problem("bwrap")
    check_sandbox(config)
    described = make_trainer(config).algorithm.describe()
    assert described.endswith("; the python tool (env.tools): sandboxed code runs in bubblewrap: a minimal "
                              "read-only view, no network (docs/sandbox.md)")


def test_a_tokenizer_with_a_response_template_reads_the_calls_with_parse_response(tiny_chat_model, tmp_path):
    """A checkpoint whose tokenizer ships a response template (here TRL's Qwen3 one, in tokenizer_config.json): the
    trainer's collector reads tool calls with transformers' `parse_response`, gives the built-in `tool_use` that
    format, and says so in the run's header; the same model without one keeps our parser."""
    import shutil

    from tests.envs.test_tool_formats import FIXTURES

    model = tmp_path / "model"
    shutil.copytree(tiny_chat_model, model)
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    schemas = json.loads((FIXTURES / "response_templates.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "response_template":
                                                             schemas["qwen3"]}))
    collectors = {}
    for name, path in (("with", model), ("without", tiny_chat_model)):
        config = tiny_run(None, tmp_path / name, f"model.path={path}", f"data.train={_chat_task(tmp_path)}",
                          "data.eval=", "data.chat_template=true", "env.name=tool_use", "env.tools=[calculator]",
                          rewards=[{"name": "math_answer"}])
        collectors[name] = make_trainer(config).algorithm.collector
    with_, without = collectors["with"], collectors["without"]
    assert with_.tool_format.parser == "parse_response" and with_.env_kwargs["tool_format"] is with_.tool_format
    assert "parsed by the tokenizer's response_template" in with_.describe()
    calls, errors = with_.tool_format.parse('<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}'
                                            '\n</tool_call>', None)
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "6*7"})] and errors == []
    assert without.tool_format.parser == "ours" and "parsed by ours: the tokenizer has no response_template" in \
        without.describe()

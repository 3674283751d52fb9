"""GRPO's verifiable rewards: the built-ins against hand-written expectations, the config checks (ConfigError naming
the entry, exit 2), and the worker pool: weighted sums in row order, failures and timeouts scored 0, counted and
logged once per (function, prompt id), hung workers killed, the pool usable after them."""

import concurrent.futures
import os
import re
import sys
import types

import numpy as np
import pytest

from jaxtrain import errors, rewards

GSM8K = ("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\nShe makes 9 * 2 = $<<9*2=18>>18 every day at the "
         "farmer's market.\n#### 18")
MATH_CASES = [(r"\boxed{\frac{1}{2}}", "0.5", 1.0), (r"\boxed{3}", "4", 0.0), ("The answer is 1/2", r"\frac12", 1.0),
              (r"so $(3, \pi/2)$", r"\left( 3, \frac{\pi}{2} \right)", 1.0), (r"\boxed{5}", r"5\sqrt{2}", 0.0),
              (r"First x = 3, so the answer is \boxed{5}.", 5, 1.0), ("So she makes 18 dollars.", GSM8K, 1.0),
              (r"The final answer is $\frac{2}{4}$", "$0.5$", 1.0), ("I do not know", "18", 0.0)]


def test_math_equal_judges_the_final_answer():
    pytest.importorskip("math_verify")
    got = [rewards.math_equal(c, a) for c, a, _ in MATH_CASES]
    assert got == [expected for _, _, expected in MATH_CASES]
    # math-verify's own timeouts use SIGALRM, which raises outside the main thread: math_equal turns them off.
    with concurrent.futures.ThreadPoolExecutor(1) as threads:
        assert list(threads.map(rewards.math_equal, *zip(*[(c, a) for c, a, _ in MATH_CASES]))) == got
    with pytest.raises(ValueError, match="cannot parse the answer"):
        rewards.math_equal(r"\boxed{1}", "")


def test_exact_match_and_format_regex():
    cases = [("42", 42, 1.0), (" 42\n", "42 ", 1.0), ("the answer is 42", "42", 0.0), ("42.0", "42", 0.0),
             ("<think>6 * 7</think>\n<answer> 42 </answer>", "42", 1.0),
             ("<answer>41</answer> no, <answer>42</answer>", "42", 1.0)]
    assert [rewards.exact_match(c, a) for c, a, _ in cases] == [expected for _, _, expected in cases]
    formats = {"<think>\nstep 1\nstep 2\n</think>\n<answer>\n42\n</answer>\n": 1.0,
               "<think>x</think><answer>42</answer>": 1.0, "<answer>42</answer>": 0.0,
               "<think>x</think><answer>42</answer> and more": 0.0, "<think>x</think>": 0.0}
    assert {c: rewards.format_regex(c) for c in formats} == formats
    boxed = rewards.regex_reward(r".*\\boxed\{.+\}")
    assert (boxed(r"so \boxed{4}"), boxed("so 4"), boxed(r"\boxed{4} then more")) == (1.0, 0.0, 0.0)
    with pytest.raises(re.error):
        rewards.regex_reward("(unclosed")


def test_check_config_reads_entries_weights_and_signatures():
    got = rewards.check_config("jaxtrain.rewards:exact_match, reward_fixtures:takes_all@-0.5,"
                               "jaxtrain.rewards:format_regex@2", field_names={"prompt", "answer"})
    assert [(r.spec, r.weight, r.takes, r.required) for r in got] == [
        ("jaxtrain.rewards:exact_match", 1.0, ("answer",), ("answer",)),
        ("reward_fixtures:takes_all", -0.5, None, ()), ("jaxtrain.rewards:format_regex", 2.0, (), ())]
    record = {"prompt": "p", "answer": 4, "completion": "a field of that name", "id": 3}
    assert [r.fields(record) for r in got] == [{"answer": 4}, {"prompt": "p", "answer": 4, "id": 3}, {}]
    # A Python config may give a list of entries.
    assert [r.spec for r in rewards.check_config(["reward_fixtures:length", "reward_fixtures:pid@3"])] == [
        "reward_fixtures:length", "reward_fixtures:pid"]


@pytest.fixture
def broken_modules(tmp_path, monkeypatch):
    (tmp_path / "raises_on_import.py").write_text("raise RuntimeError('no GPU here')\n")
    (tmp_path / "lacks_a_dependency.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize("value,field,reason", [
    ("no_such_module_xyz:score", "grpo.rewards[0]", "no module named 'no_such_module_xyz' on sys.path"),
    ("jaxtrain.rewards:exact_match,jaxtrain.rewards:no_such_fn", "grpo.rewards[1]", "has no function 'no_such_fn'"),
    ("reward_fixtures:NOT_CALLABLE", "grpo.rewards[0]", "is a int, not a function"),
    ("reward_fixtures:no_args", "grpo.rewards[0]", "must take the completion as its first positional argument"),
    ("reward_fixtures:keyword_only", "grpo.rewards[0]", "must take the completion as its first positional argument"),
    ("reward_fixtures:positional_only_field", "grpo.rewards[0]", "'answer' is positional-only"),
    ("reward_fixtures:needs_a_missing_package", "grpo.rewards[0]", "needs no_such_package_xyz, which is not installed"),
    ("jaxtrain.rewards:exact_match@heavy", "grpo.rewards[0]", "the weight 'heavy' is not a finite number"),
    ("jaxtrain.rewards:exact_match@inf", "grpo.rewards[0]", "the weight 'inf' is not a finite number"),
    ("exact_match", "grpo.rewards[0]", "expected module:function[@weight]"),
    ("tests/reward_fixtures.py:length", "grpo.rewards[0]", "expected module:function[@weight]"),
    ("reward_fixtures:length,,reward_fixtures:pid", "grpo.rewards[1]", "empty entry"),
    (" ", "grpo.rewards", "names no reward"),
    (3, "grpo.rewards", "must be a string"),
    ("raises_on_import:f", "grpo.rewards[0]", "importing raises_on_import failed: RuntimeError: no GPU here"),
    ("lacks_a_dependency:f", "grpo.rewards[0]",
     "importing lacks_a_dependency failed: ModuleNotFoundError: No module named 'no_such_dependency_xyz'"),
])
def test_bad_rewards_are_config_errors_naming_the_entry(broken_modules, value, field, reason):
    with pytest.raises(errors.ConfigError) as e:
        rewards.check_config(value)
    assert e.value.field == field and reason in e.value.reason, str(e.value)
    assert errors.exit_code(e.value) == errors.EXIT_BAD_INPUT and "\n" not in errors.message(e.value)


def test_a_field_the_prompts_lack_is_a_config_error():
    assert rewards.check_config("jaxtrain.rewards:exact_match", field_names=["prompt", "answer"])
    with pytest.raises(errors.ConfigError, match=r"^grpo\.rewards\[1\]: jaxtrain\.rewards:exact_match requires the "
                       r"field 'answer', which the prompts lack \(they have id, prompt\)$"):
        rewards.check_config("reward_fixtures:length,jaxtrain.rewards:exact_match", field_names=["prompt", "id"])
    # **fields and defaults need nothing in particular.
    assert rewards.check_config("reward_fixtures:takes_all", field_names=["prompt"])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_pool_scores_weighted_sums_in_row_order():
    spec = "reward_fixtures:length,reward_fixtures:takes_all@0.5,jaxtrain.rewards:exact_match@-2"
    completions = [str(i) * (i % 7) for i in range(40)]
    records = [{"prompt": f"p{i}", "answer": str(i) * (i % 3), **({"extra": i} if i % 2 else {})} for i in range(40)]
    reference = np.array([[r.fn(c, **r.fields(rec)) for r in rewards.check_config(spec)]
                          for c, rec in zip(completions, records)], np.float32)
    with rewards.RewardPool(spec, workers=2) as pool:
        for _ in range(2):  # the pool lives across calls
            got = pool.score(completions, records, list(range(40)))
            np.testing.assert_array_equal(got.per_function, reference)
            np.testing.assert_allclose(got.total, reference @ np.array([1, 0.5, -2], np.float32), rtol=1e-6)
            assert got.total.dtype == np.float32 and got.raised.tolist() == got.timed_out.tolist() == [0, 0, 0]
    # Every call runs in a worker process, not this one; close() ends them.
    pool = rewards.RewardPool("reward_fixtures:pid", workers=2)
    pids = {int(p) for p in pool.score(["a"] * 8, [{"prompt": "p"}] * 8, list(range(8))).total}
    assert os.getpid() not in pids and all(_alive(p) for p in pids)
    pool.close()
    assert not any(_alive(p) for p in pids)
    with pytest.raises(RuntimeError, match="closed"):
        pool.score(["a"], [{"prompt": "p"}], [0])


def test_failures_score_zero_are_counted_and_logged_once_per_prompt():
    lines = []
    spec = "reward_fixtures:boom,reward_fixtures:returns_none@2,reward_fixtures:length"
    records = [{"prompt": p} for p in ("good", "bad 1", "bad 1", "good", "bad 2")]
    ids = [10, 11, 11, 12, 13]
    with rewards.RewardPool(spec, workers=2, log=lines.append) as pool:
        got = pool.score(["ab"] * 5, records, ids)
        np.testing.assert_array_equal(got.per_function, [[1, 0, 2], [0, 0, 2], [0, 0, 2], [1, 0, 2], [0, 0, 2]])
        np.testing.assert_array_equal(got.total, [3, 2, 2, 3, 2])
        assert got.raised.tolist() == [3, 5, 0] and got.timed_out.tolist() == [0, 0, 0]
        assert pool.names == ["boom", "returns_none", "length"]
        assert got.failures == {"boom": 3, "returns_none": 5, "length": 0}
        again = pool.score(["ab"] * 5, records, ids)  # the same failures: counted again, not logged again
        assert again.raised.tolist() == [3, 5, 0] and pool.raised.tolist() == [6, 10, 0]
    assert sorted(lines) == sorted(
        [f"reward reward_fixtures:boom failed (ValueError: cannot score 'bad {n}') on prompt {i}: scored 0 "
         f"(logged once per prompt)" for n, i in ((1, 11), (2, 13))] +
        [f"reward reward_fixtures:returns_none failed (TypeError: returned NoneType, not a number) on prompt {i}: "
         f"scored 0 (logged once per prompt)" for i in (10, 11, 12, 13)])


def test_a_worker_that_dies_or_hangs_scores_zero_and_is_replaced(tmp_path):
    lines, pidfile = [], str(tmp_path / "hung.pid")
    records = [{"prompt": "p", "pidfile": pidfile}] * 3
    with rewards.RewardPool("reward_fixtures:hang,reward_fixtures:length@0.5", timeout_s=1, workers=2,
                            log=lines.append) as pool:
        got = pool.score(["ok", "hang", "ok"], records, [0, 1, 2])
        # The hung call's worker was killed, not waited for: the function sleeps 60 s.
        assert not _alive(int(open(pidfile).read()))
        np.testing.assert_array_equal(got.per_function, [[1, 2], [0, 4], [1, 2]])
        assert got.timed_out.tolist() == [1, 0] and got.raised.tolist() == [0, 0]
        assert got.failures == {"hang": 1, "length": 0}
        assert lines == ["reward reward_fixtures:hang timed out after 1 s on prompt 1: scored 0 (logged once per "
                         "prompt)"]
        # The next call gets the replacement worker's answers.
        np.testing.assert_array_equal(pool.score(["ok", "fine"], records[:2], [0, 1]).total, [2, 3])
    with rewards.RewardPool("reward_fixtures:dies,reward_fixtures:length", workers=1, log=lines.append) as pool:
        got = pool.score(["abc", "de"], [{"prompt": "p"}] * 2, [5, 5])
        np.testing.assert_array_equal(got.per_function, [[0, 3], [0, 2]])
        assert got.raised.tolist() == [2, 0]
    assert lines[1:] == ["reward reward_fixtures:dies failed (its worker process died (exit code 3)) on prompt 5: "
                         "scored 0 (logged once per prompt)"]


def test_pool_of_math_equal_in_workers():
    pytest.importorskip("math_verify")
    with rewards.RewardPool("jaxtrain.rewards:math_equal", workers=2) as pool:
        got = pool.score([c for c, _, _ in MATH_CASES], [{"prompt": "q", "answer": a} for _, a, _ in MATH_CASES],
                         list(range(len(MATH_CASES))))
    assert got.total.tolist() == [e for _, _, e in MATH_CASES] and got.raised.sum() == got.timed_out.sum() == 0


def test_a_worker_that_cannot_start_is_an_error(monkeypatch):
    """A reward the trainer can import but its workers cannot (here: a module that exists only in this process)."""
    module = types.ModuleType("only_in_this_process_xyz")
    module.score = lambda completion: 1.0
    monkeypatch.setitem(sys.modules, "only_in_this_process_xyz", module)
    pool = rewards.RewardPool(rewards.check_config("only_in_this_process_xyz:score"), workers=1)
    try:
        with pytest.raises(RuntimeError, match="a reward worker failed to start: ModuleNotFoundError: No module named "
                                               "'only_in_this_process_xyz'"):
            pool.score(["a"], [{"prompt": "p"}], [0])
    finally:
        pool.close()


def test_check_group_names_the_group_field():
    d = dict(rewards.CONFIG, rewards="jaxtrain.rewards:exact_match@2")
    assert [(r.spec, r.weight) for r in rewards.check_group(d)] == [("jaxtrain.rewards:exact_match", 2.0)]
    for key, value, field in (("reward_timeout_s", 0, "grpo.reward_timeout_s"),
                              ("reward_workers", 1.5, "grpo.reward_workers"),
                              ("rewards", "jaxtrain.rewards:nope", "grpo.rewards[0]")):
        with pytest.raises(errors.ConfigError) as e:
            rewards.check_group({**d, key: value})
        assert e.value.field == field
    with pytest.raises(errors.ConfigError, match=r"^grpo\.rewards\[0\]: .* requires the field 'answer'"):
        rewards.check_group(d, field_names=["prompt"])

"""Built-in rewards, answer extraction and the reward registry."""

import json
import math
import sys
import textwrap

import pytest

from grpo_jax import rewards
from grpo_jax.data import gsm8k as gsm8k_data
from grpo_jax.rewards import extract
from grpo_jax.run.config import ConfigError

# (completion, extracted canonical answer)
TRICKY = [
    ("The answer is 18.", "18"),
    ("<answer>$1,234.00</answer>", "1234"),
    ("so 5 + 3 = 8 dollars", "8"),
    ("\\boxed{42} took 7 steps", "42"),
    ("<answer>18</answer> and later 20", "18"),
    ("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 eggs.\n#### 72", "72"),
    ("It is -5 degrees", "-5"),
    ("5-3=2", "2"),
    ("the answer is \u22127", "-7"),
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("$\\dfrac12$", "0.5"),
    ("18.0", "18"),
    ("It costs $18.50", "18.5"),
    (".5 of a pie", "0.5"),
    ("\u20ac20", "20"),
    ("20%", "20"),
    ("1,000,000 people", "1000000"),
    ("12 apples and 3 oranges", "3"),
    ("no number here", None),
    ("<answer>twelve</answer> 12", None),
    ("<think>2+2=4</think><answer>4</answer>", "4"),
    ("so $\\boxed{36}$.", "36"),
    ("\\boxed{1,000}", "1000"),
    ("The ratio is 2/3", "2/3"),
    ("It costs $ 12 .", "12"),
    ("pi is about 3.14.", "3.14"),
    ("answer: -0.25", "-0.25"),
    ("\\$18", "18"),
    ("<answer>\n  $\\boxed{7}$ \n</answer>", "7"),
    ("Total: 5kg", "5"),
    ("<ANSWER>9</ANSWER>", "9"),
    ("\\boxed{3", "3"),  # truncated box: falls back to the last number
    ("10/0", None),
    ("", None),
]


@pytest.mark.parametrize("text,want", TRICKY)
def test_extract_answer_table(text, want):
    assert extract.extract_answer(text) == want


def test_normalize_number_equivalences():
    n = extract.normalize_number
    assert n("$1,080.00") == n("1080") == n("1080 dollars") == n("\\frac{2160}{2}") == 1080
    assert n("0.50") == n(".5") == n("1/2")
    assert n("abc") is None and n(None) is None


def test_gsm8k_reward_cases():
    fn = rewards.get("gsm8k")
    completions = ["<answer>1,080</answer>", "1080.0 dollars", "I think 1081", "no idea", "x"]
    answers = ["1080", "#### 1,080", "1080", "1080", "not a number"]
    got = fn(["q"] * 5, completions, answer=answers)
    assert got[:4] == [1.0, 1.0, 0.0, 0.0]
    assert math.isnan(got[4])


def test_gsm8k_reward_on_every_reference_solution(gsm8k_dir):
    """1.0 for each GSM8K test reference (raw and converted), 0.0 once its number changes."""
    rows = [json.loads(line) for line in (gsm8k_dir / "test.jsonl").open()]
    examples, skipped = gsm8k_data.read_gsm8k_jsonl(gsm8k_dir / "test.jsonl")
    assert len(examples) == len(rows) == 1319 and skipped == []
    fn = rewards.get("gsm8k")
    answers = [ex["answer"] for ex in examples]
    n = len(rows)
    assert fn([""] * n, [r["answer"] for r in rows], answer=answers) == [1.0] * n
    assert fn([""] * n, [ex["solution"] for ex in examples], answer=answers) == [1.0] * n
    # The raw reference is also accepted as the gold side.
    assert (
        fn([""] * n, [ex["solution"] for ex in examples], answer=[r["answer"] for r in rows])
        == [1.0] * n
    )

    def changed(ref):
        head, final = ref.rsplit("####", 1)
        value = int(final.strip().replace(",", ""))
        return f"{head}#### {value + 1}"

    assert fn([""] * n, [changed(r["answer"]) for r in rows], answer=answers) == [0.0] * n
    wrong = [
        ex["solution"].replace(f"<answer>{a}</answer>", f"<answer>{int(a) + 7}</answer>")
        for ex, a in zip(examples, answers)
    ]
    assert fn([""] * n, wrong, answer=answers) == [0.0] * n
    # Every converted solution is also in the checked format.
    assert rewards.get("format")([""] * n, [ex["solution"] for ex in examples]) == [1.0] * n


def test_format_reward():
    fn = rewards.get("format")
    cases = {
        "<think>a</think><answer>1</answer>": 1.0,
        "  <think>\nwork\n</think>\n<answer> 1 </answer>\n": 1.0,
        "<think></think><answer>1</answer>": 0.0,  # empty think
        "<think>a</think><answer> </answer>": 0.0,  # empty answer
        "<answer>1</answer>": 0.0,
        "<think>a</think><answer>1</answer> trailing": 0.0,
        "<think>a</think><answer>1</answer><answer>2</answer>": 0.0,
        "<think>a<think>b</think><answer>1</answer>": 0.0,
        "<think>a</think>": 0.0,
    }
    assert fn([""] * len(cases), list(cases)) == list(cases.values())


def test_format_reward_configured():
    reason = rewards.get("format(think_tag='reasoning', answer_tag='final')")
    assert reason(["", ""], ["<reasoning>x</reasoning><final>2</final>", "<think>x</think>"]) == [
        1.0,
        0.0,
    ]
    only_answer = rewards.make_format_reward(think_tag=None)
    assert only_answer(["", ""], ["<answer>3</answer>", "<think>x</think><answer>3</answer>"]) == [
        1.0,
        0.0,
    ]
    custom = rewards.make_format_reward(pattern=r"Answer: \d+")
    assert custom(["", ""], ["Answer: 12", "Answer: x"]) == [1.0, 0.0]


def test_overlong_penalty_golden():
    # DAPO: L_max = 10, L_cache = 4 -> 0 up to 6 tokens, then -1/4 per token, -1 past 10.
    fn = rewards.get("overlong(max_len=10, buffer=4)")
    lengths = [0, 6, 7, 8, 9, 10, 11, 50]
    want = [0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0]
    assert fn([""] * 8, ["x"] * 8, completion_lengths=lengths) == want
    assert rewards.overlong_penalty(384, 512, 128) == 0.0
    assert rewards.overlong_penalty(416, 512, 128) == -0.25


def test_overlong_needs_lengths_and_valid_options():
    fn = rewards.get("overlong")
    with pytest.raises(KeyError, match="completion_lengths"):
        fn(["p"], ["c"], answer=["1"])
    with pytest.raises(ConfigError, match="buffer=0 must be an integer in"):
        rewards.get("overlong(max_len=10, buffer=0)")
    with pytest.raises(ConfigError, match="max_len=-1 must be a positive integer"):
        rewards.get("overlong(max_len=-1)")


def test_exact_match():
    fn = rewards.get("exact_match")
    completions = [
        "<think>21+543=753</think><answer>753</answer>",
        "<answer> 753 \n</answer>",
        "<answer>357</answer>",
        "753",
        "<answer>1</answer><answer>753</answer>",
    ]
    assert fn([""] * 5, completions, answer=["753"] * 5) == [1.0, 1.0, 0.0, 0.0, 1.0]
    whole = rewards.make_exact_match(tag=None)
    assert whole(["", ""], [" 753\n", "<answer>753</answer>"], answer=["753", "753"]) == [1.0, 0.0]
    assert math.isnan(fn([""], ["x"], answer=[None])[0])


def test_countdown_reward():
    fn = rewards.get("countdown")
    nums = [3, 7, 25, 50]
    completions = [
        "<answer>(50-25)*3+7</answer>",  # 82
        "<answer>(50-25)*3+7 = 82</answer>",
        "<answer>50+25+7</answer>",  # misses 3
        "<answer>(50-25)*3+7+3</answer>",  # uses 3 twice
        "<answer>50*25</answer>",
        "<answer>__import__('os')</answer>",
        "<answer>(50-25)*3**1+7</answer>",  # power not allowed
        "no answer",
        "<answer>50/(25-25)+3+7</answer>",
    ]
    got = fn([""] * len(completions), completions, answer=["82"] * 9, numbers=[nums] * 9)
    assert got == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    value, used = rewards.builtin.eval_countdown("(24*16)/8-24")
    assert value == 24 and sorted(used) == [8, 16, 24, 24]


def test_registry_unknown_name_lists_available():
    with pytest.raises(
        ConfigError, match=r"unknown reward 'gsm9k'; available rewards: \[.*'gsm8k'"
    ):
        rewards.get("gsm9k")
    assert {"gsm8k", "math_verify", "format", "overlong", "exact_match", "countdown"} <= set(
        rewards.available()
    )


def test_registry_options_errors():
    with pytest.raises(ConfigError, match="reward 'gsm8k' takes no options"):
        rewards.get("gsm8k(x=1)")
    with pytest.raises(ConfigError, match="bad options"):
        rewards.get("overlong(max_length=3)")
    with pytest.raises(ConfigError, match="is not of the form name"):
        rewards.get("overlong(max_len=int('3'))")
    with pytest.raises(ConfigError, match="is not of the form name"):
        rewards.get("overlong(512)")
    # Built once per options string, so stateful rewards are shared.
    assert rewards.get("overlong(max_len=64, buffer=8)") is rewards.get(
        "overlong(max_len=64, buffer=8)"
    )


def test_register_duplicate_and_override():
    def a(prompts, completions, **_):
        return [1.0] * len(completions)

    def b(prompts, completions, **_):
        return [2.0] * len(completions)

    rewards.register("test_dup_reward")(a)
    rewards.register("test_dup_reward")(a)  # same object: no-op
    with pytest.raises(ValueError, match="'test_dup_reward' is already registered"):
        rewards.register("test_dup_reward")(b)
    rewards.register("test_dup_reward", override=True)(b)
    assert rewards.get("test_dup_reward")(["p"], ["c"]) == [2.0]
    with pytest.raises(ValueError, match="without parentheses"):
        rewards.register("bad(name)")


def test_load_user_module_from_file_and_name(tmp_path, monkeypatch):
    src = textwrap.dedent(
        """
        from grpo_jax import rewards

        @rewards.register("{name}")
        def length_reward(prompts, completions, **_):
            return [float(len(c)) for c in completions]
        """
    )
    path = tmp_path / "my_rewards.py"
    path.write_text(src.format(name="user_len_file"))
    rewards.load_user_module(str(path))
    rewards.load_user_module(str(path))  # idempotent
    assert rewards.get("user_len_file")(["p", "p"], ["ab", "abcd"]) == [2.0, 4.0]

    pkg = tmp_path / "pkg_rw"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "extra.py").write_text(src.format(name="user_len_module"))
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards.load_user_module("pkg_rw.extra")
    assert rewards.get("user_len_module")(["p"], ["abc"]) == [3.0]
    sys.modules.pop("pkg_rw.extra", None)
    sys.modules.pop("pkg_rw", None)


def test_load_user_module_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"reward module file '.*nope\.py' does not exist"):
        rewards.load_user_module(str(tmp_path / "nope.py"))
    with pytest.raises(ConfigError, match="reward module 'no_such_pkg.rewards' was not found"):
        rewards.load_user_module("no_such_pkg.rewards")
    bad = tmp_path / "broken_rewards.py"
    bad.write_text("import no_such_dependency_xyz\n")
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_xyz"):
        rewards.load_user_module(str(bad))

"""Reward environments: seeded problem generators plus scorers, all offline.

Every env asks for the final answer inside `<answer>...</answer>` so one extractor serves all of
them. The reward reads the same `final_answer` held-out evaluation reads (the tagged answer, else
the last number): a right tagged answer earns 1, a right untagged final number earns `partial`,
anything else 0. The half credit is shaping that gives a 135M model a gradient from the first
step (SmolLM2 rarely uses the tag at first); it pays only for a right *final* number, because
half credit for the right number anywhere in the text was gamed: the README job's model learnt
to write the right number and then keep going, so training reward rose while held-out accuracy
fell (docs/learning.md). The instruction shows the tag with no number in it: an example answer
(`<answer>42</answer>`) was copied verbatim by the model.
`correct` is the unshaped check held-out evaluation counts (rl/evaluation.py).
"""

from __future__ import annotations

import random
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Protocol

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NUMBER_RE = re.compile(r"-?\d+")
# The system turn `lorafleet rl` gives every prompt (rl/loop.py TenantConfig.system_prompt).
DEFAULT_SYSTEM_PROMPT = "Answer briefly."
# reasoning-gym config values settable from a task string (rg_options)
RgValue = int | float | bool | str
SCALARS: tuple[type, ...] = (int, float, bool, str)
INSTRUCTION = "Write the final answer as <answer>number</answer>."


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str
    entry: Any = field(default=None, compare=False)  # the generator's own record (reasoning-gym)


def extract_answer(completion: str) -> str | None:
    """The first tagged answer, stripped; None when the model did not use the tag."""
    match = ANSWER_RE.search(completion)
    return None if match is None else match.group(1).strip()


def final_answer(completion: str) -> str | None:
    """What an evaluation reads as the answer: the tagged one, else the last number (the usual
    fallback of math evals, GSM8K's among them); None when there is neither."""
    tagged = extract_answer(completion)
    if tagged is not None:
        return tagged
    numbers = NUMBER_RE.findall(completion)
    return numbers[-1] if numbers else None


class Env(Protocol):
    name: str

    def problems(self, rng: random.Random, count: int) -> list[Problem]: ...

    def score(self, problem: Problem, completion: str) -> float:
        """The training reward, shaping included."""
        ...

    def correct(self, problem: Problem, completion: str) -> bool:
        """Held-out accuracy (rl/evaluation.py): the `final_answer` is right. Unshaped: a
        right final number counts whether tagged or not (`score` pays it only `partial`)."""
        ...


def _numbers_equal(got: str, want: str) -> bool:
    try:
        return float(got.replace(",", "")) == float(want)
    except ValueError:
        return got == want


def _shaped(completion: str, partial: float, right: typing.Callable[[str], bool]) -> float:
    """1 for a right tagged answer, `partial` for a right untagged final number, else 0."""
    got = final_answer(completion)
    if got is None or not right(got):
        return 0.0
    return 1.0 if extract_answer(completion) is not None else partial


@dataclass
class ArithmeticEnv:
    """Built in, no extra dependency: `a op b` with operands in [0, max_operand].

    Reward (see the module docstring): 1 for the right number in the tag, `partial` for the right
    number as the untagged final number, else 0."""

    name: str = "arithmetic"
    max_operand: int = 10
    ops: str = "+"
    partial: float = 0.5

    def problems(self, rng: random.Random, count: int) -> list[Problem]:
        out = []
        for _ in range(count):
            a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
            op = rng.choice(self.ops)
            value = a + b if op == "+" else a - b if op == "-" else a * b
            out.append(Problem(f"What is {a} {op} {b}? {INSTRUCTION}", str(value)))
        return out

    def score(self, problem: Problem, completion: str) -> float:
        return _shaped(completion, self.partial, lambda got: _numbers_equal(got, problem.answer))

    def correct(self, problem: Problem, completion: str) -> bool:
        got = final_answer(completion)
        return got is not None and _numbers_equal(got, problem.answer)


@dataclass
class TagEnv:
    """Pure format task (the easiest learnable signal): reward 1 for `<answer>N</answer>` with a
    number inside, whatever the number. Used by the slow test and as a smoke task."""

    name: str = "tag"
    max_operand: int = 20

    def problems(self, rng: random.Random, count: int) -> list[Problem]:
        return ArithmeticEnv(max_operand=self.max_operand).problems(rng, count)

    def score(self, problem: Problem, completion: str) -> float:
        got = extract_answer(completion)
        return float(got is not None and re.fullmatch(r"-?\d+(\.\d+)?", got) is not None)

    def correct(self, problem: Problem, completion: str) -> bool:
        return self.score(problem, completion) == 1.0  # the format is the whole task


@dataclass
class ReasoningGymEnv:
    """A `reasoning-gym` task (optional dependency), scored by the task's own `score_answer`.

    The dataset is regenerated per step from the step's seed, so a resumed run sees the same
    problems it would have seen without the interruption."""

    task: str
    partial: float = 0.5
    name: str = ""
    # the task's own config fields (`rg:chain_sum:max_terms=3:max_digits=1`), already typed
    options: dict[str, RgValue] = field(default_factory=dict)
    _module: Any = field(default=None, repr=False)
    _scorer: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        try:
            import reasoning_gym
        except ImportError as exc:
            raise ValueError(
                f"task 'rg:{self.task}' needs reasoning-gym: .venv/bin/pip install reasoning-gym==0.1.25 ({exc})"
            ) from None
        self._module = reasoning_gym
        self.name = ":".join([f"rg:{self.task}", *(f"{k}={v}" for k, v in self.options.items())])
        try:
            self._scorer = reasoning_gym.create_dataset(self.task, size=1, seed=0, **self.options)
        except (KeyError, ValueError, AssertionError) as exc:
            raise ValueError(f"reasoning-gym task {self.name!r}: {exc}") from None

    def problems(self, rng: random.Random, count: int) -> list[Problem]:
        dataset = self._module.create_dataset(
            self.task, size=count, seed=rng.randrange(1 << 31), **self.options
        )
        return [
            Problem(f"{entry['question']}\n{INSTRUCTION}", str(entry["answer"]), entry)
            for entry in dataset
        ]

    def score(self, problem: Problem, completion: str) -> float:
        tagged = extract_answer(completion)
        if tagged is not None:  # the task's own graded score (stateless per entry)
            return float(self._scorer.score_answer(tagged, problem.entry))
        return _shaped(completion, self.partial, lambda got: self._right(got, problem))

    def _right(self, got: str, problem: Problem) -> bool:
        return float(self._scorer.score_answer(got, problem.entry)) >= 1.0

    def correct(self, problem: Problem, completion: str) -> bool:
        got = final_answer(completion)
        return got is not None and float(self._scorer.score_answer(got, problem.entry)) >= 1.0


BUILTIN = {"arithmetic": ArithmeticEnv, "tag": TagEnv}


def rg_options(task: str, spec: str) -> tuple[str, dict[str, RgValue]]:
    """`chain_sum:max_terms=3:max_digits=1` -> ("chain_sum", {"max_terms": 3, "max_digits": 1}).

    Each value is converted to its field's type in the task's config dataclass, so a typo in a
    name or a value is refused here, naming it, before any server starts. Only scalar fields
    (int, float, bool, str) can be set this way: `,` already separates tasks in `--tasks`."""
    name, *pairs = spec.split(":")
    if not name:
        raise ValueError(f"task {task!r}: write rg:<name>, e.g. rg:chain_sum")
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as exc:
        raise ValueError(
            f"task {task!r} needs reasoning-gym: .venv/bin/pip install reasoning-gym==0.1.25 ({exc})"
        ) from None
    if name not in DATASETS:
        raise ValueError(f"task {task!r}: reasoning-gym has no task {name!r}")
    config_cls = DATASETS[name][1]
    hints = typing.get_type_hints(config_cls)
    options: dict[str, RgValue] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"task {task!r}: {pair!r} is not key=value")
        if key in ("seed", "size") or key not in hints:
            settable = sorted(
                k for k, t in hints.items() if t in SCALARS and k not in ("seed", "size")
            )
            raise ValueError(
                f"task {task!r}: {key!r} is not a settable field of {name}; use one of {', '.join(settable)}"
            )
        kind = hints[key]
        if kind not in SCALARS:
            raise ValueError(f"task {task!r}: field {key!r} is not int, float, bool or str")
        options[key] = _convert(task, key, raw, kind)
    return name, options


def _convert(task: str, key: str, raw: str, kind: type) -> RgValue:
    if kind is bool:
        if raw.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"task {task!r}: {key}={raw!r} must be true or false")
        return raw.lower() in ("true", "1")
    if kind is str:
        return raw
    try:
        return int(raw) if kind is int else float(raw)
    except ValueError:
        raise ValueError(f"task {task!r}: {key}={raw!r} must be {kind.__name__}") from None


def make_env(task: str) -> Env:
    """`arithmetic`, `arithmetic:50` (max operand), `tag`, or `rg:<reasoning-gym task>` with
    optional config fields, `rg:chain_sum:max_terms=3:max_digits=1`."""
    name, _, arg = task.partition(":")
    if name == "rg":
        rg_name, options = rg_options(task, arg)
        return ReasoningGymEnv(rg_name, options=options)
    if name not in BUILTIN:
        raise ValueError(
            f"unknown task {task!r}; use one of {', '.join(BUILTIN)} or rg:<reasoning-gym task>"
        )
    if not arg:
        return BUILTIN[name]()
    try:
        max_operand = int(arg)
    except ValueError:
        raise ValueError(
            f"task {task!r}: the part after ':' must be the max operand, an integer"
        ) from None
    if max_operand < 1:
        raise ValueError(f"task {task!r}: max operand must be >= 1")
    return BUILTIN[name](max_operand=max_operand)

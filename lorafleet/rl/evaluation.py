"""Held-out evaluation for `lorafleet rl`: greedy accuracy on problems training never sees.

Training reward is measured on the very prompts the policy is being pushed on, at temperature
1; it cannot show over-fitting, and its noise hides small gains. Each tenant therefore draws,
once, a fixed set of evaluation problems from a seed of its own kind (a string, where training
seeds are integers: `eval_seed`), and every training draw skips a problem whose question is in
that set (`training_problems`), so the evaluated questions are held out by construction, not
only by luck of the seed: a small task such as `arithmetic:10` (121 questions) would otherwise
train on most of them. The same set is evaluated every time, greedily (temperature 0, one
sample each), so two evaluations differ only by the weights.

`eval_accuracy` is the share of held-out problems whose final answer is right (`env.correct`:
the tagged answer, else the last number in the completion; no partial credit);
`eval_reward` is the mean shaped training reward on them, and `eval_tag_rate` the share that
used the requested `<answer>` tag (what the strict format-and-answer score also needs).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from tinker import types

from lorafleet.rl.envs import Env, Problem, extract_answer

EVAL_SEED_TAG = "lorafleet-eval"
# Draws of `count` problems tried before a task is declared too small to hold out the set:
# bounds the work before the first step, whatever the task.
MAX_DRAW_ROUNDS = 100


def eval_seed(seed: int) -> str:
    """A string seed: `random.Random` hashes it (SHA-512), so it never equals a training seed
    (integers, `loop.step_seed`)."""
    return f"{EVAL_SEED_TAG}:{seed}"


@dataclass
class PendingEval:
    """One evaluation's samples in flight; `result` waits for them and scores."""

    held_out: HeldOut
    futures: list[Future[types.SampleResponse]]
    started: float

    def result(self, tokenizer: Any) -> dict[str, float | int]:
        texts = []
        for future in self.futures:
            sequences = future.result().sequences
            texts.append(
                tokenizer.decode(sequences[0].tokens, skip_special_tokens=True) if sequences else ""
            )
        return self.held_out.score(texts) | {"eval_s": time.perf_counter() - self.started}


@dataclass(frozen=True)
class HeldOut:
    env: Env
    problems: tuple[Problem, ...]
    questions: frozenset[str]

    @classmethod
    def draw(cls, env: Env, seed: int, count: int) -> HeldOut:
        """`count` distinct problems from the tenant's evaluation seed."""
        rng = random.Random(eval_seed(seed))
        chosen: dict[str, Problem] = {}
        for _ in range(MAX_DRAW_ROUNDS):
            for problem in env.problems(rng, count):
                if len(chosen) < count:
                    chosen.setdefault(problem.question, problem)
            if len(chosen) == count:
                return cls(env, tuple(chosen.values()), frozenset(chosen))
        raise ValueError(
            f"task {env.name}: only {len(chosen)} distinct problems in {MAX_DRAW_ROUNDS} draws, "
            f"fewer than --eval-prompts {count}; lower --eval-prompts or use a larger task"
        )

    def training_problems(self, rng: random.Random, count: int) -> list[Problem]:
        """`count` problems from the step's own rng, none of them held out. The first draw is
        the one training would make without evaluation; only a held-out question is replaced."""
        kept: list[Problem] = []
        for _ in range(MAX_DRAW_ROUNDS):
            kept.extend(
                p for p in self.env.problems(rng, count) if p.question not in self.questions
            )
            if len(kept) >= count:
                return kept[:count]
        raise ValueError(
            f"task {self.env.name}: too few problems left for training once the "
            f"{len(self.problems)} held-out ones are excluded; lower --eval-prompts"
        )

    def submit(
        self, sampler: Any, prompts: Sequence[Sequence[int]], max_tokens: int
    ) -> PendingEval:
        """One greedy sample per held-out prompt (rendered by the caller, in the same chat
        format as training), all in flight at once."""
        if len(prompts) != len(self.problems):
            raise ValueError(f"{len(prompts)} prompts for {len(self.problems)} held-out problems")
        params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=0)
        started = time.perf_counter()
        futures = [
            sampler.sample(types.ModelInput.from_ints(list(prompt)), 1, params)
            for prompt in prompts
        ]
        return PendingEval(self, futures, started)

    def score(self, texts: Sequence[str]) -> dict[str, float | int]:
        """The eval keys of a metrics row, from one completion per held-out problem."""
        if len(texts) != len(self.problems):
            raise ValueError(f"{len(texts)} completions for {len(self.problems)} problems")
        pairs = list(zip(self.problems, texts, strict=True))
        scores = [self.env.score(p, t) for p, t in pairs]
        n = len(scores)
        return {
            "eval_accuracy": sum(self.env.correct(p, t) for p, t in pairs) / n,
            "eval_reward": sum(scores) / n,
            "eval_tag_rate": sum(extract_answer(t) is not None for t in texts) / n,
            "eval_prompts": n,
        }

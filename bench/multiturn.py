"""A multi-turn RL sampling workload: the sampler's prefix cache on vs off, and (from
bench/multiturn_train.py) the trainer's nested-prefix sharing.

The cookbook's guess_number recipe, reduced to its token traffic: `--episodes` episodes (16)
play `--turns` turns (10) at once behind one `--game-prompt`-token game prompt (120: with the
turns' growth that averages the ~287 prompt tokens per turn issue 24 measured on the recipe,
renderer role_colon). Every turn each episode
appends `--observation` tokens (20) to its conversation and samples `--action` tokens (16,
temperature 1, seeded, no early stop) from one published LoRA version (rank 8) of SmolLM2-135M;
the next turn's prompt is the whole conversation so far, resent, as a Tinker client does. The
episodes' requests of one turn go into the SampleEngine together (one `generate`), so they share
its continuous batch.

Sides, interleaved round by round (median reported), each from an empty prefix cache:
- `cache_off`: `prefix_cache_bytes=0`: every turn prefills the whole conversation;
- `cache_on`: the default budget: a turn prefills only what the cache does not hold (the new
  observation and the blocks the previous turn's sampled tokens did not fill).

`prefix_cache_speedup` = seconds without the cache / with it, for the whole workload (target
>= 3); `turn_latency_p50_ms` is the median time of one turn (all episodes' requests of that
turn), per side. Also recorded: the tokens prefilled and the cache's hit rate, and how many
sampled sequences came out equal on both sides (the cache changes log-probs only within fp
rounding, tests/sample/test_prefix_cache.py; a sampled token can still flip in rare ties).

    .venv/bin/python -m bench.multiturn --json bench/results/multiturn.json

`bench.multiturn_train.measure(...)` runs after the sampling sides unless `--train-repeats 0`;
its figures (train_nested_prefix_speedup, ...) are merged into the table and the JSON.
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.common import (
    bench_device,
    bench_dtype,
    bench_numerics,
    parse_args,
    publish_random_adapters,
    report,
)
from lorafleet.engines import colocate
from lorafleet.model.loader import load_base
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.sample import SampleEngine, SampleRequest, SamplingParams
from lorafleet.sample.types import VersionKey

PRESET = "smollm2-135m"
RANK = 8
SIDES = ("cache_off", "cache_on")


def tokens(seed: int, count: int, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (count,), generator=gen).tolist()


class Workload:
    """The episodes' conversations; `run` plays every turn and returns each turn's seconds."""

    def __init__(
        self, episodes: int, turns: int, game: int, observation: int, action: int, vocab: int
    ):
        self.episodes, self.turns, self.action = episodes, turns, action
        self.game = tokens(0, game, vocab)
        self.observations = [
            [tokens(1 + e * turns + t, observation, vocab) for t in range(turns)]
            for e in range(episodes)
        ]

    def run(self, engine: SampleEngine, key: VersionKey) -> tuple[list[float], list[list[int]]]:
        engine.prefix_cache.clear()
        histories = [list(self.game) for _ in range(self.episodes)]
        seconds: list[float] = []
        sampled: list[list[int]] = []
        for turn in range(self.turns):
            requests = []
            for episode, history in enumerate(histories):
                history.extend(self.observations[episode][turn])
                params = SamplingParams(
                    max_tokens=self.action, temperature=1.0, seed=1000 * episode + turn, stop=[]
                )
                requests.append(SampleRequest(list(history), params, adapter=key))
            start = time.perf_counter()
            results = engine.generate(requests)
            seconds.append(time.perf_counter() - start)
            for history, result in zip(histories, results, strict=True):
                if not result.ok:
                    raise RuntimeError(f"a sample failed: {result.error}")
                history.extend(result.sequences[0].tokens)
                sampled.append(result.sequences[0].tokens)
        return seconds, sampled


def main() -> None:
    args = parse_args(
        __doc__,
        with_numerics=True,
        threads=(int, 1, "torch threads"),
        episodes=(int, 16, "episodes played at once"),
        turns=(int, 10, "turns per episode"),
        game_prompt=(int, 120, "tokens of the game prompt every episode starts with"),
        observation=(int, 20, "observation tokens appended per turn"),
        action=(int, 16, "tokens sampled per turn"),
        warmup=(int, 1, "untimed rounds first"),
        train_repeats=(int, 3, "rounds of bench.multiturn_train.measure (0: skip it)"),
    )
    torch.set_num_threads(args.threads)
    device = bench_device(args.device).device
    choice = bench_dtype(args.dtype, device)
    numerics = bench_numerics(args.numerics)
    base = load_base(PRESET, dtype=choice.dtype, device=device)
    stack = colocate(
        base.model,
        resolve_tinker_targets(base.model, train_unembed=False),
        base_model_id=PRESET,
        tokenizer=base.tokenizer,
        train_slots=1,
        sample_slots=1,
        r_max=RANK,
        max_rows=args.episodes,
        numerics=numerics,
    )
    (key,), _ = publish_random_adapters(stack, 1, RANK)
    engines = {
        "cache_off": SampleEngine(
            stack.adapted, stack.versions, max_rows=args.episodes, prefix_cache_bytes=0
        ),
        "cache_on": SampleEngine(stack.adapted, stack.versions, max_rows=args.episodes),
    }
    workload = Workload(
        args.episodes,
        args.turns,
        args.game_prompt,
        args.observation,
        args.action,
        base.model.config.vocab_size,
    )
    totals: dict[str, list[float]] = {side: [] for side in SIDES}
    turns: dict[str, list[float]] = {side: [] for side in SIDES}
    sampled: dict[str, list[list[int]]] = {}
    prefilled: dict[str, int] = {}
    hit_rate = 0.0
    for round_ in range(args.warmup + args.repeats):
        for side in SIDES:
            engine = engines[side]
            counters = engine.prefix_cache.counters
            hits, missed = counters.hit_tokens, counters.missed_tokens
            seconds, sampled[side] = workload.run(engine, key)
            prefilled[side] = counters.missed_tokens - missed
            if side == "cache_on":
                hits = counters.hit_tokens - hits
                hit_rate = hits / (hits + prefilled[side])
            print(f"round {round_} {side}: {sum(seconds):.2f} s", flush=True)
            if round_ >= args.warmup:
                totals[side].append(sum(seconds))
                turns[side].extend(seconds)
    timings = {
        side: {
            "min_s": min(totals[side]),
            "median_s": statistics.median(totals[side]),
            "runs": len(totals[side]),
        }
        for side in SIDES
    }
    speedup = timings["cache_off"]["median_s"] / timings["cache_on"]["median_s"]
    same = sum(a == b for a, b in zip(sampled["cache_off"], sampled["cache_on"], strict=True))
    latency = {side: statistics.median(turns[side]) * 1e3 for side in SIDES}
    extra: dict[str, object] = {
        "turn_latency_p50_ms": latency,
        "prompt_tokens_prefilled": prefilled,
        "prefix_cache_hit_rate": hit_rate,
        "prefix_cache_bytes_held": engines["cache_on"].prefix_cache.stats()["bytes"],
        "prefix_cache_max_bytes": engines["cache_on"].prefix_cache.max_bytes,
        "sequences_equal_on_both_sides": f"{same}/{len(sampled['cache_on'])}",
        "workload": {
            "episodes": args.episodes,
            "turns": args.turns,
            "game_prompt": args.game_prompt,
            "observation": args.observation,
            "action": args.action,
            "threads": args.threads,
        },
    }
    for side in SIDES:
        print(f"turn_latency_p50_ms {side}: {latency[side]:.1f}")
    print(f"prompt tokens prefilled: {prefilled}; hit rate {hit_rate:.3f}; equal {same}")
    ratios = {"prefix_cache_speedup": (speedup, ">= 3")}
    if args.train_repeats > 0:
        try:
            from bench.multiturn_train import measure
        except ImportError as exc:
            print(f"bench.multiturn_train is missing ({exc}): no training figures")
        else:
            train = measure(
                PRESET,
                args.dtype,
                args.episodes,
                args.turns,
                repeats=args.train_repeats,
                device=device,
            )
            extra["train"] = train
            ratios["train_nested_prefix_speedup"] = (
                float(train["train_nested_prefix_speedup"]),
                ">= 3",
            )
    report(
        f"multiturn: {PRESET} {choice.dtype}, {args.episodes} episodes x {args.turns} turns "
        f"({args.game_prompt}-token game prompt, +{args.observation} observed +{args.action} sampled "
        f"per turn), one rank-{RANK} LoRA, {args.threads} thread(s)",
        timings,
        ratios,
        args.json,
        extra,
        dtype=choice,
    )


if __name__ == "__main__":
    main()

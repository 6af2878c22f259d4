"""What the server costs over its own engine: one guess_number-shaped RL step sent through the
`tinker` SDK to `lorafleet serve` and the same datums handed straight to the trainer it serves
with (issue 31, item 6).

The step: `--groups` groups x `--group-size` episodes (default 4 x 4) of `--turns` turns
(default 10), one datum per turn, as tinker-cookbook's `multiplayer_rl.guess_number` sends them
under its `role_colon` renderer: every episode starts from the same `--prompt`-token game prompt
that ends in a 3-token "Assistant:" header; turn k's datum is its history and its 16 sampled
action tokens (the cookbook's layout: model_input = tokens[:-1], target_tokens = tokens[1:],
log-probs and the episode's advantage on the action only, `importance_sampling`); the next
turn's history re-renders that action under another header and appends a
`--observation`-token answer and a new "Assistant:" header, so turn k is not a prefix of turn
k + 1 (they share the history up to turn k's header: a *stem* for the trainer,
train/prefix_trie.py). Average history ~282 tokens per turn, like the recipe's measured
`env/all/ob_tokens_per_turn` (287, docs/performance.md). Random token ids: the cost depends on
the shapes only.

Sides, interleaved per round (`--repeats`, median reported), both running on the server's engine
worker thread, in the same process:
- server: `TrainingClient.forward_backward(datums, "importance_sampling")` and `optim_step`
  through the real SDK over loopback HTTP to an in-process `lorafleet serve` (the CLI's defaults:
  round token budget, batch window, rank-32 LoRA), waited for as the cookbook's `train_step`
  waits (both futures);
- engine: the same datums as `TrainItem`s into the server's own `TrainEngine`
  (`forward_backward` + `optim_step` on the model's slot), run on the worker thread between
  rounds (`Scheduler.call`), timed there.

`server_over_engine` is the median over rounds of server seconds / engine seconds (target
<= 1.3). The JSON also records, per side and round, the trainer calls, their seconds and tokens
forwarded (a timing hook around the trainer), the scheduler's rounds and chunks; two figures a
busy machine does not move: `outside_trainer_s` (each side's seconds outside the trainer's
calls, median) and `server_tokens_over_engine` (tokens the trainer forwarded for the server's
step over the engine's); and a check that the server's forward log-probs equal the engine's
for the same datums on the same weights.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.server_overhead --json bench/results/server_overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.common import environment, fixed_dtype

HEADER, ACTION = 3, 16
KEY = "tml-server-overhead-bench-0123456789"
LOSS = "importance_sampling"
LEARNING_RATE = 3e-5  # the recipe's default


@dataclass(frozen=True)
class TurnDatum:
    """One turn's datum as plain tensors: what the SDK sends and what the engine is handed."""

    tokens: torch.Tensor  # model_input (int64)
    target_tokens: torch.Tensor  # int64
    logprobs: torch.Tensor  # float32, the sampler's, on the action only
    advantages: torch.Tensor  # float32, the episode's advantage on the action only


def guess_number_step(
    vocab: int,
    *,
    groups: int = 4,
    group_size: int = 4,
    turns: int = 10,
    prompt: int = 120,
    observation: int = 17,
    seed: int = 0,
) -> list[TurnDatum]:
    """The datums of one step, episode by episode, turn by turn (the cookbook's order). Each
    group's episodes share one advantage baseline: advantages are centred within the group."""
    gen = torch.Generator().manual_seed(seed)

    def draw(n: int) -> torch.Tensor:
        return torch.randint(0, vocab, (n,), generator=gen)

    game = draw(prompt - HEADER)
    assistant, player = draw(HEADER), draw(HEADER)
    data: list[TurnDatum] = []
    for _ in range(groups):
        rewards = torch.rand(group_size, generator=gen)
        advantages = rewards - rewards.mean()
        for episode in range(group_size):
            history = torch.cat([game, assistant])
            for _ in range(turns):
                action = draw(ACTION)
                sampled = torch.cat([history, action])
                length = sampled.numel() - 1
                on_action = (torch.arange(length) >= history.numel() - 1).float()
                data.append(
                    TurnDatum(
                        tokens=sampled[:-1].clone(),
                        target_tokens=sampled[1:].clone(),
                        logprobs=on_action * -torch.rand(length, generator=gen) * 3,
                        advantages=on_action * float(advantages[episode]),
                    )
                )
                # the next turn's history: this action re-rendered under the player's header
                history = torch.cat(
                    [history[:-HEADER], player, action, draw(observation), assistant]
                )
    return data


def sdk_datums(data: list[TurnDatum]) -> list[Any]:
    from tinker import types

    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(d.tokens.tolist()),
            loss_fn_inputs={
                "target_tokens": types.TensorData.from_torch(d.target_tokens),
                "logprobs": types.TensorData.from_torch(d.logprobs),
                "advantages": types.TensorData.from_torch(d.advantages),
            },
        )
        for d in data
    ]


def engine_items(slot: int, data: list[TurnDatum]) -> list[Any]:
    from lorafleet.train.engine import TrainItem

    return [
        TrainItem(
            slot,
            d.tokens,
            LOSS,
            {"target_tokens": d.target_tokens, "logprobs": d.logprobs, "advantages": d.advantages},
        )
        for d in data
    ]


@dataclass
class TrainerTally:
    """What the trainer did while a side ran: calls, their seconds, tokens forwarded."""

    forward_backward_calls: int = 0
    forward_backward_s: float = 0.0
    optim_calls: int = 0
    optim_s: float = 0.0
    tokens_run: int = 0
    items: int = 0
    calls: list[dict[str, float]] = field(default_factory=list)

    def record(self) -> dict[str, Any]:
        return {
            "forward_backward_calls": self.forward_backward_calls,
            "forward_backward_s": self.forward_backward_s,
            "optim_calls": self.optim_calls,
            "optim_s": self.optim_s,
            "tokens_run": self.tokens_run,
            "items": self.items,
        }


class TrainerHook:
    """Wraps the trainer's `forward_backward` and `optim_step` (instance attributes, so only
    this trainer) to tally what each side makes it do."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.tally = TrainerTally()
        self._fb = trainer.forward_backward
        self._optim = trainer.optim_step
        trainer.forward_backward = self._forward_backward
        trainer.optim_step = self._optim_step

    def _forward_backward(self, items: Any) -> Any:
        began = time.perf_counter()
        out = self._fb(items)
        self.tally.forward_backward_calls += 1
        self.tally.forward_backward_s += time.perf_counter() - began
        self.tally.tokens_run += out.tokens_run
        self.tally.items += len(items)
        return out

    def _optim_step(self, hparams: Any) -> Any:
        began = time.perf_counter()
        out = self._optim(hparams)
        self.tally.optim_calls += 1
        self.tally.optim_s += time.perf_counter() - began
        return out

    @contextmanager
    def counting(self) -> Iterator[TrainerTally]:
        self.tally = TrainerTally()
        yield self.tally

    def close(self) -> None:
        del self.trainer.forward_backward
        del self.trainer.optim_step


def fair_share_cuts(costs: list[int], budget: int) -> list[tuple[int, int]]:
    """The chunks fair share cuts one lone call into at `budget` tokens a round (its default
    quantum), as the scheduler would without solo rounds."""
    from lorafleet.server.ops.fair_share import DeficitRoundRobin, Work

    drr = DeficitRoundRobin(max(1, budget // 4), lambda tenant: 1.0)
    cuts, done = [], 0
    while done < len(costs):
        take = drr.plan({"t": [Work("call", "m", done, tuple(costs))]}, budget)[0]
        cuts.append((take.start, take.stop))
        done = take.stop
    return cuts


def run_cuts(args: argparse.Namespace) -> dict[str, Any]:
    """`--cuts`: the step's datums straight into a trainer, as one call, as one call per
    episode, and in the chunks 512-token rounds cut it into: which costs, the calls or the
    cuts (the trainer shares a history only among the datums of one call)."""
    from lorafleet.model.adapted import AdaptedModel
    from lorafleet.model.banks import AdapterSpec
    from lorafleet.model.loader import load_base
    from lorafleet.model.targets import resolve_tinker_targets
    from lorafleet.server.ops.fair_share import datum_costs
    from lorafleet.server.ops.scheduler import DEFAULT_ROUND_TOKENS
    from lorafleet.train.engine import TrainEngine

    dtype = fixed_dtype(args.dtype, "the recipe's measurement (fp32)")
    model = load_base(args.base_model, dtype=args.dtype, device="cpu").model
    adapted = AdaptedModel(model, resolve_tinker_targets(model))
    adapted.add_bank("train", num_slots=2, r_max=args.rank)
    trainer = TrainEngine(adapted, base_model_id=args.base_model)
    slot = trainer.create_adapter(AdapterSpec(rank=args.rank, alpha=32.0, seed=0))
    data = guess_number_step(
        trainer.vocab_size,
        groups=args.groups,
        group_size=args.group_size,
        turns=args.turns,
        prompt=args.prompt,
        observation=args.observation,
    )
    items = engine_items(slot, data)
    budget = args.round_token_budget or DEFAULT_ROUND_TOKENS
    plans = {
        "one call": [(0, len(items))],
        "per episode": [(i, i + args.turns) for i in range(0, len(items), args.turns)],
        f"fair share {budget}": fair_share_cuts(datum_costs([d.tokens for d in data]), budget),
    }
    grads = trainer.bank.grads
    assert grads is not None
    trainer.forward_backward(items[: args.turns])  # first-call costs
    rows = []
    for r in range(args.repeats):
        for name, plan in plans.items():
            began, tokens = time.perf_counter(), 0
            for start, stop in plan:
                tokens += trainer.forward_backward(items[start:stop]).tokens_run
            seconds = time.perf_counter() - began
            grads.zero_()
            rows.append(
                {
                    "plan": name,
                    "round": r,
                    "calls": len(plan),
                    "tokens_run": tokens,
                    "seconds": seconds,
                }
            )
            print(
                f"{name}: {len(plan)} calls, {tokens} tokens forwarded, {seconds:.1f} s", flush=True
            )
    return {
        "benchmark": "server overhead --cuts: one guess_number-shaped step, cut three ways",
        "runs": rows,
        "step": {"datums": len(data), "tokens": sum(int(d.tokens.numel()) for d in data)},
        "environment": environment(dtype),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here as JSON")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per side")
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed steps of one episode's datums first"
    )
    parser.add_argument("--base-model", default="smollm2-135m", help="preset or local HF dir")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--prompt", type=int, default=120, help="game prompt tokens")
    parser.add_argument("--observation", type=int, default=17, help="answer tokens per turn")
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank (the recipe's default)")
    parser.add_argument(
        "--torch-threads", type=int, default=None, help="the server's (default: torch's)"
    )
    parser.add_argument(
        "--round-token-budget",
        type=int,
        default=None,
        help="the server's (default: the CLI's default)",
    )
    parser.add_argument(
        "--batch-window-ms", type=float, default=5.0, help="the server's (the CLI's default)"
    )
    parser.add_argument(
        "--cuts",
        action="store_true",
        help="no server: the datums straight into a trainer as one call, per episode, and in "
        "the round budget's fair-share chunks (the diagnosis)",
    )
    args = parser.parse_args(argv)
    for name in ("repeats", "groups", "group_size", "turns", "prompt", "observation", "rank"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.prompt <= HEADER:
        parser.error(f"--prompt must be > {HEADER} (it ends in a header), got {args.prompt}")
    return args


def _stats(scheduler: Any) -> dict[str, int]:
    s = scheduler.stats
    return {"rounds": s.rounds, "chunks": s.chunks, "split_ops": s.split_ops}


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import tinker
    from tinker import types

    from lorafleet.adapters.hparams import AdamHParams
    from lorafleet.engines import EngineConfig
    from lorafleet.server.config import ServerConfig
    from lorafleet.server.main import ServerThread, free_port
    from lorafleet.server.ops.scheduler import DEFAULT_ROUND_TOKENS

    dtype = fixed_dtype(args.dtype, "the recipe's measurement (fp32)")
    budget = args.round_token_budget or DEFAULT_ROUND_TOKENS
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="server-overhead-") as tmp:
        config = ServerConfig(
            base_model=args.base_model,
            data_dir=Path(tmp) / "data",
            api_keys=[KEY],
            port=free_port(),
            engine=EngineConfig(
                base_model=args.base_model,
                dtype=args.dtype,
                max_lora_rank=max(32, args.rank),
                max_adapters=2,
                sampler_slots=2,
            ),
            torch_threads=args.torch_threads,
            batch_window_s=args.batch_window_ms / 1000.0,
            round_token_budget=budget,
            tokenizer_cache=Path(tmp) / "hub",
        )
        server = ServerThread(config)
        hook: TrainerHook | None = None
        try:
            service = server.service
            scheduler = service.scheduler
            executor = service.executor
            sc = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
            tc = sc.create_lora_training_client(
                base_model=str(executor.base_path), rank=args.rank, seed=0
            ).result()
            model_id = tc.model_id
            trainer = executor.trainer
            slot: int = scheduler.call(lambda: executor.live.get(model_id).slot).result()
            data = guess_number_step(
                trainer.vocab_size,
                groups=args.groups,
                group_size=args.group_size,
                turns=args.turns,
                prompt=args.prompt,
                observation=args.observation,
            )
            datums = sdk_datums(data)
            items = engine_items(slot, data)
            adam = types.AdamParams(learning_rate=LEARNING_RATE, beta1=0.9, beta2=0.95, eps=1e-8)
            hparams = AdamHParams(learning_rate=LEARNING_RATE, beta1=0.9, beta2=0.95, eps=1e-8)
            hook = TrainerHook(trainer)
            server_logprobs: list[torch.Tensor] = []

            def server_step() -> float:
                began = time.perf_counter()
                fb = tc.forward_backward(datums, LOSS)
                opt = tc.optim_step(adam)
                out = fb.result()
                opt.result()
                seconds = time.perf_counter() - began
                server_logprobs[:] = [o["logprobs"].to_torch() for o in out.loss_fn_outputs]
                return seconds

            engine_logprobs: list[torch.Tensor] = []

            def engine_step() -> float:
                def work() -> float:
                    began = time.perf_counter()
                    out = trainer.forward_backward(items)
                    trainer.optim_step({slot: hparams})
                    seconds = time.perf_counter() - began
                    engine_logprobs[:] = [o.logprobs for o in out.items]
                    return seconds

                seconds: float = scheduler.call(work).result()
                return seconds

            sides: dict[str, Callable[[], float]] = {"server": server_step, "engine": engine_step}
            for _ in range(args.warmup):  # first-call costs, on one episode's datums
                began = time.perf_counter()
                tc.forward_backward(datums[: args.turns], LOSS).result()
                tc.optim_step(adam).result()
                print(f"warm-up: {time.perf_counter() - began:.2f} s", flush=True)
            times: dict[str, list[float]] = {name: [] for name in sides}
            tallies: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
            for r in range(args.repeats):
                for name, fn in sides.items():
                    before = _stats(scheduler)
                    with hook.counting() as tally:
                        seconds = fn()
                    times[name].append(seconds)
                    tallies[name].append(
                        {
                            **tally.record(),
                            **_delta(_stats(scheduler), before),
                            "seconds": seconds,
                        }
                    )
                    print(
                        f"round {r} {name}: {seconds:.2f} s ({tally.forward_backward_calls} "
                        f"forward_backward calls, {tally.forward_backward_s:.2f} s in them, "
                        f"{tally.tokens_run} tokens forwarded)",
                        flush=True,
                    )
            # The last server and engine rounds ran the same datums on weights one step apart,
            # so compare one more pair on the same weights: engine forward, then server forward.
            same: list[torch.Tensor] = []

            def engine_forward() -> None:
                same[:] = [o.logprobs for o in trainer.forward(items).items]

            scheduler.call(engine_forward).result()
            fwd = tc.forward(datums, LOSS).result()
            served = [o["logprobs"].to_torch() for o in fwd.loss_fn_outputs]
            diff = max(
                float((a - b.to(a.dtype)).abs().max()) for a, b in zip(same, served, strict=True)
            )
            ratios = [s / e for s, e in zip(times["server"], times["engine"], strict=True)]
            # Load-independent: what each side spent outside the trainer's own calls, and how
            # many tokens the trainer forwarded for the server against the engine.
            outside = {
                name: statistics.median(
                    r["seconds"] - r["forward_backward_s"] - r["optim_s"] for r in rounds
                )
                for name, rounds in tallies.items()
            }
            tokens_ratio = statistics.median(
                s["tokens_run"] / e["tokens_run"]
                for s, e in zip(tallies["server"], tallies["engine"], strict=True)
            )
            result = {
                "benchmark": "server overhead: one guess_number-shaped step, SDK vs engine",
                "server_over_engine": statistics.median(ratios),
                "ratios": ratios,
                "targets": {"server_over_engine": "<= 1.3"},
                "timings": {
                    name: {
                        "min_s": min(v),
                        "median_s": statistics.median(v),
                        "runs": len(v),
                        "all_s": v,
                    }
                    for name, v in times.items()
                },
                "per_round": tallies,
                "outside_trainer_s": outside,
                "server_tokens_over_engine": tokens_ratio,
                "forward_logprob_max_diff": diff,
                "step": {
                    "datums": len(data),
                    "tokens": sum(int(d.tokens.numel()) for d in data),
                    "groups": args.groups,
                    "group_size": args.group_size,
                    "turns": args.turns,
                    "prompt": args.prompt,
                    "observation": args.observation,
                    "action": ACTION,
                    "rank": args.rank,
                },
                "server": {
                    "round_token_budget": budget,
                    "batch_window_ms": args.batch_window_ms,
                    "torch_threads": executor.torch_threads,
                },
                "environment": environment(dtype),
            }
        finally:
            if hook is not None:
                hook.close()
            server.stop()
    return result


def print_table(result: dict[str, Any]) -> None:
    step = result["step"]
    print(
        f"\n{result['benchmark']}: {step['datums']} datums, {step['tokens']} tokens, rank "
        f"{step['rank']}, round budget {result['server']['round_token_budget']}, "
        f"{result['server']['torch_threads']} torch thread(s)"
    )
    print(f"{'side':<10}{'min s':>10}{'median s':>10}{'fb calls':>10}{'fb s':>10}{'tokens':>10}")
    for name, t in result["timings"].items():
        last = result["per_round"][name][-1]
        print(
            f"{name:<10}{t['min_s']:>10.2f}{t['median_s']:>10.2f}"
            f"{last['forward_backward_calls']:>10}{last['forward_backward_s']:>10.2f}"
            f"{last['tokens_run']:>10}"
        )
    print(
        f"\nserver_over_engine {result['server_over_engine']:.3f} (target <= 1.3; per round "
        f"{', '.join(f'{r:.2f}' for r in result['ratios'])})"
    )
    outside = result["outside_trainer_s"]
    print(
        f"outside the trainer's calls (median): server {outside['server']:.2f} s, engine "
        f"{outside['engine']:.2f} s; tokens forwarded server / engine "
        f"{result['server_tokens_over_engine']:.2f}"
    )
    print(f"forward log-prob max |server - engine|: {result['forward_logprob_max_diff']:.3g}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if args.cuts:
        result = run_cuts(args)
    else:
        result = run(args)
        print_table(result)
    if args.json is not None:
        from lorafleet.fsio import atomic_write_bytes, ensure_private_dir

        ensure_private_dir(args.json.parent)
        atomic_write_bytes(args.json, (json.dumps(result, indent=2) + "\n").encode())
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

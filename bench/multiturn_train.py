"""A multi-turn RL batch's forward_backward: nested prefixes shared (the engine's default) vs not.

The batch the cookbook's guess_number recipe trains on when each turn is its own datum:
`--episodes` episodes (default 16) of `--turns` turns (default 10) behind one 40-token game
prompt; each turn appends 20 observation tokens and 16 sampled action tokens, and each turn's
item is the whole history up to its action (the cookbook's layout: input = tokens[:-1],
targets = tokens[1:]), with importance_sampling on that turn's action tokens only (its own
sampled log-probs, its own advantage). One adapter (rank 8, every Tinker target, the head
included) on SmolLM2-135M.

`--rerendered 1`: each turn's history renders the previous action with another first token, so
no turn is a prefix of the next; each shares its history with the last turn (stems,
prefix_trie.py). guess_number's own data look like that: role_colon samples each action after an
"Assistant:" header but renders past actions under "Player:", so the cookbook cannot merge an
episode's turns into one datum.

Sides, interleaved per round (median reported; `--threads` torch threads, default 1):
- unshared: every item runs its whole history (share_prefixes=False);
- shared: each episode's turns ride on its last turn (lorafleet/train/prefix_trie.py), or with
  `--rerendered 1` continue its cache after their shared history.

Both compute the same numbers (tests/train/test_nested_prefix.py, fp32 to ~1e-5; the max
log-prob difference between the sides is printed and recorded).

    .venv/bin/python -m bench.multiturn_train --dtype float32 --json bench/results/multiturn_train.json

`measure()` is also merged into bench/multiturn.py's JSON.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bench.common import bench_device, bench_dtype, interleaved, parse_args, report
from lorafleet.hardware import DtypeChoice
from lorafleet.model.adapted import AdaptedModel
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.kernel_check import prove_fused_kernel
from lorafleet.model.loader import load_base
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.train.engine import BatchOutput, TrainEngine, TrainItem

PRESET = "smollm2-135m"
PROMPT, OBSERVATION, ACTION = 40, 20, 16
RANK = 8
SIDES = ("shared", "unshared")


def episode_items(
    slot: int,
    vocab: int,
    prompt: torch.Tensor,
    turns: int,
    gen: torch.Generator,
    rerendered: bool = False,
) -> list[TrainItem]:
    """One episode's turn items: turn k's input is the history through its action, less the
    last token; the loss sits on that action's targets only. `rerendered`: the next turn's
    history renders the action with another first token (a renderer that re-tokenizes it), so
    turn k is no longer a prefix of turn k + 1 (guess_number's layout under role_colon)."""
    history = prompt
    items = []
    for _ in range(turns):
        history = torch.cat([history, torch.randint(0, vocab, (OBSERVATION,), generator=gen)])
        start = history.numel()  # the action's first token
        action = torch.randint(0, vocab, (ACTION,), generator=gen)
        sampled = torch.cat([history, action])
        if rerendered:
            action = torch.cat([(action[:1] + 1) % vocab, action[1:]])
        history = torch.cat([history, action])
        length = sampled.numel() - 1
        on_action = (torch.arange(length) >= start - 1).float()
        advantage = float(torch.randn((), generator=gen))
        inputs = {
            "target_tokens": sampled[1:].clone(),
            "logprobs": on_action * -torch.rand(length, generator=gen) * 3,
            "advantages": on_action * advantage,
        }
        items.append(TrainItem(slot, sampled[:-1].clone(), "importance_sampling", inputs))
    return items


def multiturn_batch(
    slot: int, vocab: int, episodes: int, turns: int, rerendered: bool = False
) -> list[TrainItem]:
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (PROMPT,), generator=gen)  # the game's instructions
    return [
        item
        for _ in range(episodes)
        for item in episode_items(slot, vocab, prompt, turns, gen, rerendered)
    ]


def _run(
    base_model: str,
    dtype: str,
    episodes: int,
    turns: int,
    repeats: int,
    warmup: int,
    rerendered: bool,
    device: str = "cpu",
) -> tuple[dict, dict[str, dict[str, float]], DtypeChoice]:
    choice = bench_dtype(dtype, device)
    model = load_base(base_model, dtype=choice.dtype, device=device).model
    adapted = AdaptedModel(model, resolve_tinker_targets(model))
    adapted.add_bank("train", num_slots=2, r_max=RANK)
    adapted.kernel_verdict = prove_fused_kernel(adapted, RANK)  # as the engines do on CUDA
    engines = {
        side: TrainEngine(adapted, base_model_id=base_model, share_prefixes=side == "shared")
        for side in SIDES
    }
    first = engines["shared"]
    slot = first.create_adapter(AdapterSpec(rank=RANK, alpha=2.0 * RANK, seed=0))
    with torch.no_grad():  # a trained-looking adapter, so B is not zero
        first.bank.params[slot].normal_(
            0, 0.02, generator=torch.Generator(first.device).manual_seed(1)
        )
    items = multiturn_batch(slot, first.vocab_size, episodes, turns, rerendered)
    prepared = first.prepare(items)
    runs: dict[str, BatchOutput] = {}
    grads = first.bank.grads
    assert grads is not None  # a trainable bank

    def side(name: str) -> Callable[[], None]:
        def run() -> None:
            runs[name] = engines[name].forward_backward(prepared)
            grads.zero_()

        return run

    timings = interleaved({name: side(name) for name in SIDES}, repeats=repeats, warmup=warmup)
    worst = max(
        float((a.logprobs - b.logprobs).abs().max())
        for a, b in zip(runs["shared"].items, runs["unshared"].items, strict=True)
    )
    result = {
        "train_nested_prefix_speedup": timings["unshared"]["median_s"]
        / timings["shared"]["median_s"],
        "shared_s": timings["shared"]["median_s"],
        "unshared_s": timings["unshared"]["median_s"],
        "tokens_forwarded_shared": runs["shared"].tokens_run,
        "tokens_forwarded_unshared": runs["unshared"].tokens_run,
        "train_items": len(items),
        "train_item_tokens": sum(p.length for p in prepared),
        "train_microbatches": {name: out.num_microbatches for name, out in runs.items()},
        "train_max_logprob_diff": worst,
        "train_dtype": choice.dtype,
        "train_layout": "rerendered" if rerendered else "nested",
    }
    return result, timings, choice


def measure(
    base_model: str,
    dtype: str,
    episodes: int = 16,
    turns: int = 10,
    repeats: int = 3,
    warmup: int = 0,
    rerendered: bool = False,
    device: str = "cpu",
) -> dict:
    """The figures of one run (times are medians over `repeats` interleaved rounds); what
    bench/multiturn.py merges into its JSON. No warm-up round by default: each side runs for
    seconds, so a first round's one-time costs are noise, and a round costs minutes on CPU."""
    return _run(base_model, dtype, episodes, turns, repeats, warmup, rerendered, device)[0]


def main() -> None:
    args = parse_args(
        __doc__,
        threads=(int, 1, "torch threads"),
        episodes=(int, 16, "episodes in the batch"),
        turns=(int, 10, "turns per episode (one item each)"),
        model=(str, PRESET, "base model (preset or local HF directory)"),
        warmup=(int, 0, "untimed rounds first"),
        rerendered=(int, 0, "1: each turn re-renders the last action (not a strict prefix)"),
    )
    torch.set_num_threads(args.threads)
    result, timings, choice = _run(
        args.model,
        args.dtype,
        args.episodes,
        args.turns,
        args.repeats,
        args.warmup,
        bool(args.rerendered),
        bench_device(args.device).device,
    )
    report(
        f"multiturn_train: {args.model} {choice.dtype}, {args.episodes} episodes x {args.turns} "
        f"turn items ({PROMPT}-token prompt, +{OBSERVATION} observed +{ACTION} sampled per turn), "
        f"{result['train_layout']} turns, importance_sampling, rank {RANK}, "
        f"{args.threads} thread(s)",
        timings,
        {"train_nested_prefix_speedup": (result["train_nested_prefix_speedup"], ">= 3")},
        args.json,
        extra={k: v for k, v in result.items() if k != "train_nested_prefix_speedup"},
        dtype=choice,
    )
    print(
        f"tokens forwarded: shared {result['tokens_forwarded_shared']}, unshared "
        f"{result['tokens_forwarded_unshared']} (items hold {result['train_item_tokens']})"
    )
    print(f"max |logprob shared - unshared|: {result['train_max_logprob_diff']:.3g}")


if __name__ == "__main__":
    main()

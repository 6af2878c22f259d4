"""Loop mechanics on tiny-qwen3 (random weights, so rewards come from a test env whose reward a
random model can move): advantages, datum layout, metrics, PNG, adapters, resume, Ctrl-C."""

from __future__ import annotations

import _thread
import json
import random
import re
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lorafleet.rl import envs
from lorafleet.rl.datums import group_advantages, rl_datum, sft_datum
from lorafleet.rl.envs import ArithmeticEnv, Problem, TagEnv, extract_answer, make_env
from lorafleet.rl.loop import RLConfig, TenantConfig, run_rl


@dataclass
class ShortEnv:
    """Reward = share of the completion that is digits or spaces: noisy on a random model, so
    groups have non-zero advantages and the loop does real work."""

    name: str = "short"

    def problems(self, rng: random.Random, count: int) -> list[Problem]:
        return [Problem(f"say {rng.randint(0, 9)}", "0") for _ in range(count)]

    def score(self, problem: Problem, completion: str) -> float:
        return sum(c.isdigit() or c.isspace() for c in completion) / max(len(completion), 1)

    def correct(self, problem: Problem, completion: str) -> bool:
        return self.score(problem, completion) == 1.0


@pytest.fixture(autouse=True)
def short_env(monkeypatch):
    monkeypatch.setitem(envs.BUILTIN, "short", ShortEnv)


def tenants(*names: str, **kw) -> list[TenantConfig]:
    base = dict(
        task="short", prompts_per_step=2, group_size=3, max_tokens=6, learning_rate=1e-2, rank=4
    )
    return [TenantConfig(name=n, seed=i, **(base | kw)) for i, n in enumerate(names)]


def config(run_dir: Path, ts: list[TenantConfig], steps: int, **kw) -> RLConfig:
    # ShortEnv has 10 questions: hold out 2 (evaluated every 2 steps), train on the other 8
    kw = {"eval_every": 2, "eval_prompts": 2} | kw
    return RLConfig(
        "tiny-qwen3", run_dir, ts, steps=steps, save_every=2, progress=False, torch_threads=1, **kw
    )


def trained(rows: list[dict]) -> list[dict]:
    """Training rows (the final evaluation is a row of its own, without reward keys)."""
    return [r for r in rows if "reward_mean" in r]


def test_advantages_are_centred_per_group():
    adv = group_advantages([1.0, 0.0, 0.5, 0.5])
    assert adv == [0.5, -0.5, 0.0, 0.0]
    assert sum(adv) == 0.0
    assert group_advantages([0.3, 0.3]) == [0.0, 0.0]


def test_rl_datum_zeroes_the_prompt_and_carries_sampler_logprobs():
    d = rl_datum([5, 6, 7], [8, 9], [-0.5, -1.5], 0.25)
    assert d.model_input.to_ints() == [5, 6, 7, 8]
    inputs = {k: v.data for k, v in d.loss_fn_inputs.items()}
    assert inputs["target_tokens"] == [0, 0, 8, 9]
    assert inputs["logprobs"] == [0.0, 0.0, -0.5, -1.5]
    assert inputs["advantages"] == [0.0, 0.0, 0.25, 0.25]
    with pytest.raises(ValueError, match="2 sampled tokens but 1"):
        rl_datum([5], [8, 9], [-0.5], 1.0)


def test_sft_datum_shifts_weights():
    d = sft_datum([1, 2, 3, 4], [0, 0, 1, 1])
    assert d.model_input.to_ints() == [1, 2, 3]
    assert d.loss_fn_inputs["target_tokens"].data == [2, 3, 4]
    assert d.loss_fn_inputs["weights"].data == [0.0, 1.0, 1.0]


def test_the_reward_pays_exactly_what_held_out_evaluation_counts_right():
    """Issue 36: the shaped reward reads the same final answer as `correct`, so no completion
    earns reward while evaluation counts it wrong (or the reverse), tag or no tag."""
    p = Problem("What is 7 - 9?", "-2")
    env = ArithmeticEnv()
    texts = [
        "-2",
        "7 - 9 = -2",
        "7-9=-2.",
        "<answer>-2</answer>",
        "<answer> -2 </answer> then 4",
        "-2, or 3",
        "<answer>2</answer> -2",
        "<answer></answer> -2",
        "2",
        "-2 <answer>x</answer>",
        "<answer>-2.0</answer>",
        "7 - 9 = -2\n<answer>-2</answer>",
        "",
        "minus two",
    ]
    for text in texts:
        assert (env.score(p, text) > 0) == env.correct(p, text), text


def test_env_scoring():
    p = Problem("What is 2 + 3?", "5")
    env = ArithmeticEnv()
    assert env.score(p, "It is <answer>5</answer>") == 1.0
    assert env.score(p, "2 + 3 = 5") == env.partial
    assert env.score(p, "<answer>6</answer>") == 0.0
    # the half credit reads the final number only: a right number followed by more is not it
    assert env.score(p, "2 + 3 = 5, and 5 + 1 = 6") == 0.0
    assert env.score(p, "<answer>6</answer> or 5") == 0.0  # a tag is the answer, wrong here
    assert env.score(p, "no number") == 0.0
    assert TagEnv().score(p, "<answer>17</answer>") == 1.0
    assert TagEnv().score(p, "<answer>five</answer>") == 0.0
    assert extract_answer("x <answer> 12 </answer> <answer>3</answer>") == "12"
    problems = make_env("arithmetic:3").problems(random.Random(1), 5)
    assert len(problems) == 5 and all("<answer>" in q.question for q in problems)
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        make_env("nope")
    with pytest.raises(ValueError, match="max operand"):
        make_env("arithmetic:x")


def test_reasoning_gym_env_scores_with_its_own_scorer():
    pytest.importorskip("reasoning_gym")
    env = make_env("rg:chain_sum")
    [problem] = env.problems(random.Random(0), 1)
    assert env.score(problem, f"<answer>{problem.answer}</answer>") == 1.0
    assert env.score(problem, f"so {problem.answer}.") == 0.5
    assert env.score(problem, f"{problem.answer}, not 1234567") == 0.0  # not the final number
    assert env.score(problem, "<answer>nonsense</answer>") == 0.0


def test_run_writes_metrics_curve_adapters_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    results = run_rl(config(run_dir, tenants("a", "b"), steps=3))
    for name in ("a", "b"):
        r = results[name]
        assert r.error is None
        rows = [
            json.loads(line) for line in (run_dir / name / "metrics.jsonl").read_text().splitlines()
        ]
        assert [row["step"] for row in rows] == [0, 1, 2, 3]
        train_rows = trained(rows)
        assert [row["step"] for row in train_rows] == [0, 1, 2]
        assert all(row["rollouts"] == 6 and 0.0 <= row["reward_mean"] <= 1.0 for row in train_rows)
        assert any(row["trained_rows"] > 0 for row in train_rows)
        # held-out evaluation before the first update, every 2 steps and after the last
        evals = {row["step"]: row for row in rows if "eval_accuracy" in row}
        assert sorted(evals) == [0, 2, 3]
        for row in evals.values():
            assert row["eval_prompts"] == 2 and 0.0 <= row["eval_accuracy"] <= 1.0
            assert {"eval_reward", "eval_tag_rate", "eval_s"} <= set(row)
        assert set(rows[-1]) == {"step", "time"} | {k for k in rows[-1] if k.startswith("eval")}
        assert (Path(r.adapter_dir) / "adapter_config.json").is_file()
        assert json.loads((run_dir / name / "state.json").read_text())["step"] == 3
        assert (run_dir / name / "metrics.jsonl").stat().st_mode & 0o077 == 0
    png = (run_dir / "reward.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert int.from_bytes(png[16:20], "big") == 1400  # two 7-inch panels: reward, eval
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["tenants"]["a"]["steps"] == 3 and not summary["interrupted"]
    assert summary["tenants"]["a"]["eval_first_step"] == 0
    assert summary["tenants"]["a"]["eval_last_step"] == 3
    assert summary["tenants"]["a"]["eval_last"] == evals[3]["eval_accuracy"]

    with pytest.raises(ValueError, match="--resume"):
        run_rl(config(run_dir, tenants("a", "b"), steps=5))
    resumed = run_rl(config(run_dir, tenants("a", "b"), steps=5, resume=True))
    assert resumed["a"].error is None
    rows = [json.loads(line) for line in (run_dir / "a" / "metrics.jsonl").read_text().splitlines()]
    # the old final evaluation (step 3) made way for training step 3; evaluated at 4 and 5
    assert [row["step"] for row in trained(rows)] == [0, 1, 2, 3, 4]
    assert [row["step"] for row in rows if "eval_accuracy" in row] == [0, 2, 4, 5]
    assert json.loads((run_dir / "a" / "state.json").read_text())["step"] == 5
    assert resumed["a"].state_path != results["a"].state_path  # a new model, loaded from the state


@pytest.fixture
def sigint_raises():
    """Ctrl-C as an interactive shell delivers it. A job started in the background (`cmd &`
    from a script) inherits SIGINT ignored, Python then leaves it so, and interrupt_main()
    does nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_saves_and_exits_cleanly(tmp_path, sigint_raises):
    fired = []

    def interrupt(name: str, row: dict) -> None:
        if row["step"] == 1 and not fired:
            fired.append(name)
            _thread.interrupt_main()  # what Ctrl-C does: KeyboardInterrupt in the main thread

    run_dir = tmp_path / "run"
    results = run_rl(config(run_dir, tenants("a"), steps=50), on_step=interrupt)
    assert fired
    r = results["a"]
    assert r.error is None and 2 <= len(r.metrics) < 50
    assert json.loads((run_dir / "a" / "state.json").read_text())["step"] == len(r.metrics)
    assert (Path(r.adapter_dir) / "adapter_model.safetensors").is_file()
    assert json.loads((run_dir / "summary.json").read_text())["interrupted"] is True


def test_bad_tenant_config_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="loss 'sgd'"):
        run_rl(config(tmp_path, tenants("a", loss_fn="sgd"), steps=1))
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        run_rl(config(tmp_path, tenants("a", group_size=1), steps=1))
    with pytest.raises(ValueError, match="unique"):
        run_rl(config(tmp_path, tenants("a", "a"), steps=1))
    for bad in (-0.5, float("nan"), float("inf")):  # refused before any server starts
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            run_rl(config(tmp_path, tenants("a", temperature=bad), steps=1))


def test_two_tenants_together_match_each_alone(tmp_path):
    """Sampling seeds depend only on (tenant seed, step), so a tenant's trajectory is the same
    alone or sharing batches, up to float differences in mixed passes; rewards over the run
    must agree within 0.05 (measured twice: per-step rewards identical on tiny-qwen3)."""
    ts = tenants("a", "b", loss_fn="ppo")
    together = run_rl(config(tmp_path / "both", ts, steps=3))
    for t in ts:
        alone = run_rl(config(tmp_path / t.name, [t], steps=3))[t.name]
        mean_alone = sum(r["reward_mean"] for r in trained(alone.metrics)) / 3
        mean_together = sum(r["reward_mean"] for r in trained(together[t.name].metrics)) / 3
        assert abs(mean_alone - mean_together) <= 0.05, (t.name, mean_alone, mean_together)


def _tiny_tokenizer():
    from transformers import AutoTokenizer

    from lorafleet.model.loader import resolve_base

    return AutoTokenizer.from_pretrained(str(resolve_base("tiny-qwen3")[1]))


def test_sft_rows_weigh_only_assistant_and_completion_tokens():
    from lorafleet.rl.sft import encode_row

    tok = _tiny_tokenizer()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
    tokens, weights = encode_row(tok, {"messages": messages}, "x:1")
    prompt = tok.apply_chat_template(messages[:1], tokenize=True, add_generation_prompt=True)
    prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
    assert weights[: len(prompt)] == [0.0] * len(prompt)
    assert all(w == 1.0 for w in weights[len(prompt) :]) and len(weights) > len(prompt)
    tokens, weights = encode_row(tok, {"prompt": "2+2=", "completion": "4"}, "x:2")
    n_prompt = len(tok("2+2=", add_special_tokens=False)["input_ids"])
    assert weights == [0.0] * n_prompt + [1.0] * (len(tokens) - n_prompt)
    with pytest.raises(ValueError, match="x:3: a row needs 'messages'"):
        encode_row(tok, {"text": "a"}, "x:3")
    with pytest.raises(ValueError, match=r"x:4: messages\[0\] needs"):
        encode_row(tok, {"messages": [{"role": "user"}]}, "x:4")


def test_sft_bad_jsonl_names_the_line(tmp_path):
    from lorafleet.rl.sft import load_rows

    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n\n{not json\n')
    with pytest.raises(ValueError, match=r"d.jsonl:3: not valid JSON"):
        load_rows(path)


def test_cli_rl_and_sft_run_end_to_end(tmp_path, capsys):
    from lorafleet.cli import main

    rc = main(
        [
            "rl",
            "--base-model",
            "tiny-qwen3",
            "--tenants",
            "2",
            "--tasks",
            "arithmetic,tag",
            "--steps",
            "1",
            "--prompts",
            "1",
            "--group-size",
            "2",
            "--max-tokens",
            "3",
            "--no-progress",
            "--numerics",
            "batch-invariant",
            "--run-dir",
            str(tmp_path / "rl"),
        ]
    )
    assert rc == 0
    assert (tmp_path / "rl" / "t1-tag" / "adapter" / "adapter_config.json").is_file()
    recorded = json.loads((tmp_path / "rl" / "config.json").read_text())
    # --device auto: the first CUDA device where there is one
    assert recorded["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")
    assert recorded["device_choice"]["requested"] == "auto" and recorded["device_choice"]["name"]
    assert recorded["numerics"] == "batch-invariant"  # the whole run through the invariant path
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)}) + "\n" for i in range(6)
        )
    )
    rc = main(
        [
            "sft",
            "--base-model",
            "tiny-qwen3",
            "--data",
            str(data),
            "--steps",
            "2",
            "--batch-size",
            "2",
            "--no-progress",
            "--run-dir",
            str(tmp_path / "sft"),
        ]
    )
    assert rc == 0
    summary = json.loads((tmp_path / "sft" / "summary.json").read_text())
    assert summary["held_out_rows"] == 1 and summary["eval_loss_after"] is not None
    sft_config = json.loads((tmp_path / "sft" / "config.json").read_text())
    sft_device = sft_config["device"]
    assert sft_config["numerics"] == "fast"  # the default (model/numerics.py DEFAULT_NUMERICS)
    assert sft_device == ("cuda:0" if torch.cuda.is_available() else "cpu")
    assert (tmp_path / "sft" / "adapter" / "adapter_config.json").is_file()
    assert main(["rl", "--tenants", "1", "--lr", "x", "--run-dir", str(tmp_path / "bad")]) == 2
    assert "--lr 'x'" in capsys.readouterr().err
    bad = ["rl", "--tenants", "2", "--temperature", "1.0,hot", "--run-dir", str(tmp_path / "bad")]
    assert main(bad) == 2
    assert "--temperature '1.0,hot'" in capsys.readouterr().err


def test_held_out_problems_are_never_trained_on():
    """The evaluation set comes from a seed of its own kind and training skips its questions,
    even on a task small enough that training would otherwise draw most of them."""
    from lorafleet.rl.evaluation import HeldOut, eval_seed
    from lorafleet.rl.loop import step_seed

    env = ArithmeticEnv(max_operand=10)  # 121 questions
    held = HeldOut.draw(env, seed=0, count=32)
    assert len(held.problems) == 32 == len(held.questions)
    assert not isinstance(eval_seed(0), int) and eval_seed(0) != eval_seed(1)
    seen = set()
    for step in range(200):
        seen |= {p.question for p in held.training_problems(random.Random(step_seed(0, step)), 8)}
    assert not seen & held.questions
    assert len(seen) == 121 - 32  # training still covers everything else
    # without evaluation training would have drawn held-out questions: the skip is real
    unfiltered = {
        p.question
        for step in range(200)
        for p in env.problems(random.Random(step_seed(0, step)), 8)
    }
    assert unfiltered & held.questions
    # same seed, same set (a resumed run evaluates the same problems); another seed, another set
    assert HeldOut.draw(env, seed=0, count=32).questions == held.questions
    assert HeldOut.draw(env, seed=1, count=32).questions != held.questions


def test_without_evaluation_the_curve_has_one_panel_and_rows_no_eval_keys(tmp_path):
    results = run_rl(config(tmp_path / "run", tenants("a"), steps=2, eval_every=0))
    assert [row["step"] for row in results["a"].metrics] == [0, 1]
    assert not any(k.startswith("eval") for row in results["a"].metrics for k in row)
    png = (tmp_path / "run" / "reward.png").read_bytes()
    assert int.from_bytes(png[16:20], "big") == 700


def test_held_out_draw_keeps_training_draws_when_nothing_collides():
    from lorafleet.rl.evaluation import HeldOut

    env = ArithmeticEnv(max_operand=10_000)
    held = HeldOut.draw(env, seed=3, count=8)
    assert held.training_problems(random.Random(5), 4) == env.problems(random.Random(5), 4)


def test_held_out_scores_greedy_accuracy():
    from lorafleet.rl.evaluation import HeldOut

    env = ArithmeticEnv(max_operand=10)
    held = HeldOut.draw(env, seed=0, count=4)
    answers = [p.answer for p in held.problems]
    texts = [
        f"<answer>{answers[0]}</answer>",  # right, tagged
        f"it is {answers[1]}",  # right as the last number, untagged: counts, half the reward
        f"<answer>-1</answer> {answers[2]}",  # the tag wins over a later right number: wrong
        f"{answers[3]} + 1 = 99",  # a right number that is not the final answer: wrong
    ]
    scores = held.score(texts)
    assert scores["eval_accuracy"] == 0.5
    # the reward reads the same final answer: 1 + partial, nothing for the two wrong ones
    assert scores["eval_reward"] == pytest.approx((1.0 + env.partial) / 4)
    assert scores["eval_tag_rate"] == 0.5 and scores["eval_prompts"] == 4


def test_too_small_a_task_for_the_held_out_set_is_refused_up_front(tmp_path):
    with pytest.raises(ValueError, match="--eval-prompts 11"):
        run_rl(config(tmp_path / "run", tenants("a"), steps=1, eval_prompts=11))
    with pytest.raises(ValueError, match="lower --eval-prompts"):
        run_rl(config(tmp_path / "run", tenants("a"), steps=1, eval_prompts=10))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--eval-every", "-1", "--eval-every must be >= 0"),
        ("--eval-prompts", "0", "--eval-prompts must be 1..1024, got 0"),
        ("--eval-prompts", "1025", "--eval-prompts must be 1..1024, got 1025"),
        ("--steps", "0", "--steps must be >= 1, got 0"),
    ],
)
def test_cli_refuses_bad_eval_flags_naming_them(tmp_path, capsys, flag, value, message):
    from lorafleet.cli import EXIT_USER_ERROR, main

    run_dir = tmp_path / "rl"
    rc = main(["rl", "--base-model", "tiny-qwen3", "--run-dir", str(run_dir), flag, value])
    assert rc == EXIT_USER_ERROR
    assert message in capsys.readouterr().err
    assert not run_dir.exists()


def test_reasoning_gym_task_options_are_typed_and_checked():
    pytest.importorskip("reasoning_gym")
    env = make_env("rg:chain_sum:max_terms=3:max_digits=1:allow_negation=false")
    problems = env.problems(random.Random(0), 20)
    assert all(len(p.entry["metadata"]["expression"].split()) <= 5 for p in problems)
    assert all(abs(int(p.answer)) <= 27 for p in problems)
    for bad, message in [
        ("rg:chain_sum:max_terms=x", "max_terms='x' must be int"),
        ("rg:chain_sum:nope=1", "'nope' is not a settable field of chain_sum"),
        ("rg:chain_sum:seed=1", "'seed' is not a settable field"),
        ("rg:chain_sum:max_terms", "'max_terms' is not key=value"),
        ("rg:chain_sum:allow_negation=maybe", "must be true or false"),
        ("rg:chain_sum:min_terms=4:max_terms=3", "max_terms must be >= min_terms"),
        ("rg:no_such_task", "reasoning-gym has no task 'no_such_task'"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            make_env(bad)


def test_cli_tenant_names_drop_task_options():
    from lorafleet.cli import tenant_name

    assert tenant_name(1, "rg:chain_sum:max_terms=3") == "t1-rg-chain_sum"
    assert tenant_name(0, "arithmetic:50") == "t0-arithmetic-50"


def test_readme_job_is_the_one_bench_learning_checks():
    """README command 1, the CLI's defaults and bench/learning.py's job are one job: the
    three-seed table in docs/learning.md is about what a newcomer runs."""
    from bench.learning import README_JOB
    from lorafleet.cli import build_parser

    root = Path(__file__).resolve().parents[2]
    command = " ".join(
        ["HF_HUB_OFFLINE=1 .venv/bin/lorafleet rl", *README_JOB, "--run-dir runs/rl"]
    )
    assert command in (root / "README.md").read_text()
    assert command in (root / "docs" / "learning.md").read_text()
    args = build_parser().parse_args(["rl"])
    flags = dict(zip(README_JOB[::2], README_JOB[1::2], strict=True))
    assert args.tasks == flags["--tasks"] and str(args.tenants) == flags["--tenants"]
    assert args.lr == flags["--lr"] and str(args.steps) == flags["--steps"]


def test_progress_line_keeps_the_training_figures_beside_the_latest_evaluation():
    from lorafleet.rl.loop import _stats

    rows = [
        {
            "step": 0,
            "reward_mean": 0.25,
            "tag_rate": 0.5,
            "loss_per_token": None,
            "eval_accuracy": 0.5,
        },
        {"step": 1, "reward_mean": 0.375, "tag_rate": 0.25, "loss_per_token": 0.01},
        {"step": 2, "eval_accuracy": 0.75},
    ]
    assert _stats(rows) == "reward 0.375  tag 0.25  loss +0.0100  eval 0.750 (step 2)"
    assert _stats(rows[:2]) == "reward 0.375  tag 0.25  loss +0.0100  eval 0.500 (step 0)"


def test_off_policy_runs_ahead_within_k_with_stable_reinforce(tmp_path, capsys):
    """--max-steps-off-policy 2: sampling runs ahead of training by at most 2 versions, every
    step trains with stable_reinforce on server-recorded samples (provenance checked: a refused
    datum would fail the step), and the summary reports the staleness."""
    results = run_rl(config(tmp_path, tenants("a"), steps=5, max_steps_off_policy=2))
    rows = trained(results["a"].metrics)
    assert results["a"].error is None and [r["step"] for r in rows] == list(range(5))
    assert {r["loss_fn"] for r in rows} == {"stable_reinforce"}
    stale = [r["staleness"] for r in rows]
    assert all(0 <= s <= 2 for s in stale) and stale[0] == 0
    assert any(r["trained_rows"] > 0 for r in rows)
    summary = json.loads((tmp_path / "summary.json").read_text())["tenants"]["a"]
    assert summary["staleness_max"] == max(stale)
    assert "up to 2 steps off-policy" in capsys.readouterr().out
    # held-out evaluations ride with the rollouts: they name the weights they measured
    evaluated = [r for r in rows if "eval_accuracy" in r]
    assert [r["step"] for r in evaluated] == [0, 2, 4]
    assert all(r["step"] - 2 <= r["eval_version"] <= r["step"] for r in evaluated)


def test_sync_runs_keep_importance_sampling_and_zero_staleness(tmp_path):
    results = run_rl(config(tmp_path, tenants("a"), steps=2))
    assert {(r["loss_fn"], r["staleness"]) for r in trained(results["a"].metrics)} == {
        ("importance_sampling", 0)
    }


def test_negative_off_policy_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--max-steps-off-policy must be >= 0"):
        run_rl(config(tmp_path, tenants("a"), steps=1, max_steps_off_policy=-1))

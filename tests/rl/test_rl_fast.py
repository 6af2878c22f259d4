"""Loop mechanics on tiny-qwen3 (random weights, so rewards come from a test env whose reward a
random model can move): advantages, datum layout, metrics, PNG, adapters, resume, Ctrl-C."""

from __future__ import annotations

import _thread
import json
import random
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


@pytest.fixture(autouse=True)
def short_env(monkeypatch):
    monkeypatch.setitem(envs.BUILTIN, "short", ShortEnv)


def tenants(*names: str, **kw) -> list[TenantConfig]:
    base = dict(
        task="short", prompts_per_step=2, group_size=3, max_tokens=6, learning_rate=1e-2, rank=4
    )
    return [TenantConfig(name=n, seed=i, **(base | kw)) for i, n in enumerate(names)]


def config(run_dir: Path, ts: list[TenantConfig], steps: int, **kw) -> RLConfig:
    return RLConfig(
        "tiny-qwen3", run_dir, ts, steps=steps, save_every=2, progress=False, torch_threads=1, **kw
    )


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


def test_env_scoring():
    p = Problem("What is 2 + 3?", "5")
    env = ArithmeticEnv()
    assert env.score(p, "It is <answer>5</answer>") == 1.0
    assert env.score(p, "2 + 3 = 5") == env.partial
    assert env.score(p, "<answer>6</answer>") == 0.0
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
        assert [row["step"] for row in rows] == [0, 1, 2]
        assert all(row["rollouts"] == 6 and 0.0 <= row["reward_mean"] <= 1.0 for row in rows)
        assert any(row["trained_rows"] > 0 for row in rows)
        assert (Path(r.adapter_dir) / "adapter_config.json").is_file()
        assert json.loads((run_dir / name / "state.json").read_text())["step"] == 3
        assert (run_dir / name / "metrics.jsonl").stat().st_mode & 0o077 == 0
    assert (run_dir / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["tenants"]["a"]["steps"] == 3 and not summary["interrupted"]

    with pytest.raises(ValueError, match="--resume"):
        run_rl(config(run_dir, tenants("a", "b"), steps=5))
    resumed = run_rl(config(run_dir, tenants("a", "b"), steps=5, resume=True))
    assert resumed["a"].error is None
    rows = [json.loads(line) for line in (run_dir / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2, 3, 4]
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


def test_two_tenants_together_match_each_alone(tmp_path):
    """Sampling seeds depend only on (tenant seed, step), so a tenant's trajectory is the same
    alone or sharing batches, up to float differences in mixed passes; rewards over the run
    must agree within 0.05 (measured twice: per-step rewards identical on tiny-qwen3)."""
    ts = tenants("a", "b", loss_fn="ppo")
    together = run_rl(config(tmp_path / "both", ts, steps=3))
    for t in ts:
        alone = run_rl(config(tmp_path / t.name, [t], steps=3))[t.name]
        mean_alone = sum(r["reward_mean"] for r in alone.metrics) / 3
        mean_together = sum(r["reward_mean"] for r in together[t.name].metrics) / 3
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


def test_off_policy_runs_ahead_within_k_with_stable_reinforce(tmp_path, capsys):
    """--max-steps-off-policy 2: sampling runs ahead of training by at most 2 versions, every
    step trains with stable_reinforce on server-recorded samples (provenance checked: a refused
    datum would fail the step), and the summary reports the staleness."""
    results = run_rl(config(tmp_path, tenants("a"), steps=5, max_steps_off_policy=2))
    rows = results["a"].metrics
    assert results["a"].error is None and [r["step"] for r in rows] == list(range(5))
    assert {r["loss_fn"] for r in rows} == {"stable_reinforce"}
    stale = [r["staleness"] for r in rows]
    assert all(0 <= s <= 2 for s in stale) and stale[0] == 0
    assert any(r["trained_rows"] > 0 for r in rows)
    summary = json.loads((tmp_path / "summary.json").read_text())["tenants"]["a"]
    assert summary["staleness_max"] == max(stale)
    assert "up to 2 steps off-policy" in capsys.readouterr().out


def test_sync_runs_keep_importance_sampling_and_zero_staleness(tmp_path):
    results = run_rl(config(tmp_path, tenants("a"), steps=2))
    assert {(r["loss_fn"], r["staleness"]) for r in results["a"].metrics} == {
        ("importance_sampling", 0)
    }


def test_negative_off_policy_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--max-steps-off-policy must be >= 0"):
        run_rl(config(tmp_path, tenants("a"), steps=1, max_steps_off_policy=-1))

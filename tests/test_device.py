"""`--device auto|cpu|cuda|cuda:N`: resolved before anything loads, refused (naming what was
found) where the device is missing, carried into the engines, and every tensor of the
colocated stack lives there."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lorafleet.engines import EngineConfig, build_engines, device_report, plan_engine_config
from lorafleet.hardware import (
    DeviceChoice,
    DeviceUnavailableError,
    parse_device,
    resolve_device,
)
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.loader import load_base
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.sample import SampleRequest, SamplingParams
from lorafleet.sample.engine import SampleEngine
from lorafleet.train.engine import TrainEngine, TrainItem
from lorafleet.train.optim import AdamHParams

REPO = Path(__file__).resolve().parents[1]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class FakeCuda:
    """A machine described for `resolve_device` (the `CudaProbe` seam)."""

    def __init__(self, built: str | None, names: list[str], free: int = 100 << 30):
        self.built, self.names, self.free = built, names, free

    def built_with_cuda(self) -> str | None:
        return self.built

    def device_count(self) -> int:
        return len(self.names)

    def device_name(self, index: int) -> str:
        return self.names[index]

    def memory(self, index: int) -> tuple[int, int]:
        return self.free, 141 << 30


# --------------------------------------------------------------------------- resolution


@pytest.mark.parametrize("value", ["auto", "cpu", "cuda", "cuda:0", "cuda:3", " CUDA:1 "])
def test_device_names_accepted(value):
    assert parse_device(value) == value.strip().lower()


@pytest.mark.parametrize("value", ["gpu", "cpu:0", "cuda:", "cuda:-1", "auto:1", "", "mps"])
def test_device_names_refused_naming_the_flag(value):
    with pytest.raises(ValueError, match="--device"):
        parse_device(value)


def test_auto_is_the_first_cuda_device_when_there_is_one_else_the_cpu():
    h200 = FakeCuda("12.8", ["NVIDIA H200", "NVIDIA H200"])
    choice = resolve_device("auto", cuda=h200)
    assert choice.device == "cuda:0" and choice.name == "NVIDIA H200" and choice.is_cuda
    assert choice.total_bytes == 141 << 30 and choice.free_bytes == 100 << 30
    assert resolve_device("cuda", cuda=h200).device == "cuda:0"
    assert resolve_device("cuda:1", cuda=h200).device == "cuda:1"
    assert resolve_device("cpu", cuda=h200).device == "cpu"
    cpu = resolve_device("auto", cuda=FakeCuda(None, []))
    assert cpu.device == "cpu" and not cpu.is_cuda and cpu.reason == "auto: no CUDA device"
    line = choice.describe()
    assert line.startswith("cuda:0 (NVIDIA H200, 141.0 GiB, 100.0 GiB free;")
    assert json.loads(json.dumps(choice.record()))["device"] == "cuda:0"


@pytest.mark.parametrize(
    "machine,asked,found",
    [
        (FakeCuda(None, []), "cuda", "CPU-only build, without CUDA"),
        (FakeCuda("12.8", []), "cuda:0", "sees no CUDA device"),
        (FakeCuda("12.8", ["NVIDIA H200"]), "cuda:1", "1 CUDA device(s): cuda:0 NVIDIA H200"),
    ],
)
def test_a_missing_cuda_device_is_refused_naming_what_was_found(machine, asked, found):
    with pytest.raises(
        DeviceUnavailableError, match=f"--device {asked}: no such CUDA device"
    ) as err:
        resolve_device(asked, cuda=machine)
    assert found in str(err.value)
    assert isinstance(err.value, ValueError)  # a user error: the commands exit 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize(
    "command",
    [
        ["rl", "--steps", "1", "--run-dir", "runs/rl"],
        ["sft", "--data", "data.jsonl", "--run-dir", "runs/sft"],
        ["serve", "--base-model", "tiny-qwen3", "--data-dir", "data"],
        ["demo", "--out", "runs/demo"],
    ],
    ids=["rl", "sft", "serve", "demo"],
)
def test_device_cuda_without_cuda_exits_at_once_writing_nothing(tmp_path, command):
    """Non-zero, a message naming the missing CUDA, nothing written; well under 10 s of CPU
    (wall time on a shared machine says little, so the child's CPU time is what is bounded)."""
    if command[0] == "sft":
        (tmp_path / "data.jsonl").write_text('{"prompt": "a", "completion": "b"}\n' * 2)
    before = sorted(p.name for p in tmp_path.iterdir())
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "lorafleet.cli", *command, "--device", "cuda"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - usage.ru_utime) + (after.ru_stime - usage.ru_stime)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "--device cuda: no such CUDA device here" in out.stderr
    assert "without CUDA" in out.stderr or "no CUDA device" in out.stderr
    assert "Traceback" not in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert cpu_s < 10, cpu_s


# --------------------------------------------------------------------------- the stack


def _tensors(root: object, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor reachable from `root` through lorafleet, torch and transformers objects
    and containers (each once)."""
    seen: set[int] = set()
    stack: list[tuple[str, object]] = [(name, root)]
    while stack:
        path, obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            yield path, obj
            continue
        if isinstance(obj, dict):
            stack.extend((f"{path}[{k!r}]", v) for k, v in obj.items())
        elif isinstance(obj, list | tuple | set | frozenset):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(obj))
        elif type(obj).__module__.split(".")[0] in (
            "lorafleet",
            "torch",
            "transformers",
        ) and hasattr(obj, "__dict__"):
            stack.extend((f"{path}.{k}", v) for k, v in vars(obj).items())


# Host memory by design: the optimizers' per-slot step counts and pending flags (bias
# corrections are computed on the host, without a device sync; train/optim.py).
HOST_BOOKKEEPING = (".step_count", ".pending")


@pytest.mark.parametrize("device", DEVICES)
def test_every_tensor_of_the_colocated_stack_is_on_the_configured_device(device):
    """After a training step, a publish and mixed sampling (so that the KV cache, the prefix
    cache and the optimizer state exist): every parameter, buffer, bank, optimizer moment and
    cache tensor of the trainer, the sampler and the version store is on `device`."""
    base = load_base("tiny-qwen3", dtype="float32", device=device)
    targets = resolve_tinker_targets(base.model)
    config = EngineConfig(
        base_model="tiny-qwen3", max_adapters=2, sampler_slots=2, max_lora_rank=8, device=device
    )
    engines = build_engines(config, base, targets)
    trainer, sampler = engines.trainer, engines.sampler
    assert isinstance(trainer, TrainEngine) and isinstance(sampler, SampleEngine)
    slot = trainer.create_adapter(AdapterSpec(rank=4, alpha=8.0, seed=1))
    tokens = torch.arange(3, 40)
    trainer.forward_backward(
        [
            TrainItem(
                slot,
                tokens[:-1],
                "cross_entropy",
                {"target_tokens": tokens[1:], "weights": torch.ones(36)},
            )
        ]
    )
    trainer.optim_step({slot: AdamHParams(learning_rate=1e-2)})
    key = engines.versions.publish("a", trainer.bank, slot)
    params = SamplingParams(max_tokens=4, temperature=0.0, stop=[])
    prompt = list(range(5, 45))  # long enough for whole prefix-cache blocks
    results = sampler.generate([SampleRequest(prompt, params, adapter=a) for a in (key, None)])
    assert all(r.ok for r in results)
    found = dict(
        _tensors({"trainer": trainer, "sampler": sampler, "versions": engines.versions}, "stack")
    )
    want = torch.device(device)
    wrong = {
        path: str(t.device)
        for path, t in found.items()
        if t.device.type != want.type and not path.endswith(HOST_BOOKKEEPING)
    }
    assert not wrong, wrong
    # the walk reached every kind of tensor the stack holds
    kinds = {
        "base weights": "._parameters",
        "base buffers": "._buffers",
        "bank rows": ".params",
        "gradients": ".grads",
        "AdamW moments": ".exp_avg_sq",
        "KV cache": ".cache.layers[",
        "prefix cache blocks": ".prefix_cache._",
    }
    missing = [kind for kind, part in kinds.items() if not any(part in p for p in found)]
    assert not missing, missing
    report = device_report(plan_engine_config(config, base, targets), engines)
    assert report["device"].startswith(device) and report["memory_plan"] is not None
    # on CUDA the fused kernel and graph decode are on, each having passed its start-up check
    # (the report says why not otherwise); on the CPU neither applies
    kernel, graphs = report["lora_kernel"], report["cuda_graphs"]
    assert kernel["fused"] is (device == "cuda"), kernel
    assert graphs["enabled"] is (device == "cuda"), graphs


def test_an_engine_config_off_the_base_models_device_is_refused():
    base = load_base("tiny-qwen3", dtype="float32", device="cpu")
    config = EngineConfig(base_model="tiny-qwen3", max_adapters=1, device="cuda:0")
    with pytest.raises(ValueError, match="base model's weights are on"):
        build_engines(
            plan_engine_config(
                config, base, resolve_tinker_targets(base.model), memory=lambda: (8 << 30, 16 << 30)
            ),
            base,
            resolve_tinker_targets(base.model),
        )


def test_a_device_choice_is_plain_data():
    choice = DeviceChoice("cpu", "auto", "test cpu", None, None, "auto: no CUDA device")
    assert choice.describe() == "cpu (test cpu; auto: no CUDA device)"


# --------------------------------------------------------------------------- the flags


def _serve_args(*extra: str):
    from lorafleet.cli import build_parser

    return build_parser().parse_args(
        ["serve", "--base-model", "tiny-qwen3", "--data-dir", "d", *extra]
    )


def test_serve_leaves_unset_sizes_to_the_memory_plan_and_keeps_given_ones():
    from lorafleet.cli import MEMORY_FLAGS, _memory_sizes

    sizes = _memory_sizes(_serve_args())
    assert sizes["memory_planned"] == frozenset(MEMORY_FLAGS)
    assert {k: sizes[k] for k in MEMORY_FLAGS} == MEMORY_FLAGS  # the CPU's values
    given = _memory_sizes(_serve_args("--max-adapters", "3", "--token-budget", "512"))
    assert given["max_adapters"] == 3 and given["token_budget"] == 512
    assert given["memory_planned"] == {"max_sample_rows", "prefix_cache_bytes"}
    for bad in (["--max-adapters", "0"], ["--max-sample-rows", "x"], ["--device", "gpu"]):
        with pytest.raises(SystemExit):
            _serve_args(*bad)


def test_placement_flags_follow_the_device_and_need_ray():
    from lorafleet.cli import _dist_config

    ray = _dist_config(
        _serve_args("--ray", "local", "--sampler-resource", "lorafleet_sampler"), "cuda:0"
    )
    assert ray is not None and ray.device == "cuda" and ray.sampler_resource == "lorafleet_sampler"
    cpu = _dist_config(_serve_args("--ray", "local", "--trainer-device", "cpu"), "cuda:0")
    assert cpu is not None and cpu.device == "cpu"
    with pytest.raises(SystemExit, match="--sampler-resource places Ray actors: it needs --ray"):
        _dist_config(_serve_args("--sampler-resource", "x"), "cpu")
    with pytest.raises(SystemExit, match="trainer_resource places Ray actors"):
        _dist_config(_serve_args("--trainer-ranks", "2", "--trainer-resource", "x"), "cpu")

"""Server pieces without the SDK round trip: protobuf codecs, keys, paths, seq ordering."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from tinker.proto import response_conv
from tinker.proto import tinker_public_pb2 as pb

from lorafleet.sample.types import SampledSequence, SampleResult
from lorafleet.server.engine import responses
from lorafleet.server.errors import Unauthorized, UserError
from lorafleet.server.http import proto
from lorafleet.server.ops.futures import Result
from lorafleet.server.ops.scheduler import Scheduler
from lorafleet.server.state.keys import KeyRing, load_keys, parse_keys
from lorafleet.server.state.paths import parse_tinker_path, run_dir_name
from lorafleet.server.state.retention import EphemeralRetention
from tests.server.jobs import job


def _request(**tensors: pb.Tensor) -> pb.ForwardBackwardRequest:
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.array([1, 2, 3], dtype="<i4").tobytes()
    for key, tensor in tensors.items():
        datum.loss_fn_inputs[key].CopyFrom(tensor)
    return msg


def test_decode_dense_sparse_and_bfloat16():
    dense = pb.Tensor(
        dense=np.array([4, 5, 6], dtype="<i8").tobytes(), dtype=pb.DTYPE_INT64, shape=[3]
    )
    bf16 = pb.Tensor(
        dense=(np.array([0.5, 1.0, -2.0], dtype="<f4").view("<u4") >> 16).astype("<u2").tobytes(),
        dtype=pb.DTYPE_BFLOAT16,
    )
    sparse = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[3, 2])
    sparse.sparse_csr.values = np.array([1.5, 2.5], dtype="<f4").tobytes()
    sparse.sparse_csr.crow_indices = np.array([0, 1, 1, 2], dtype="<i8").tobytes()
    sparse.sparse_csr.col_indices = np.array([1, 0], dtype="<i8").tobytes()
    call = proto.decode_call(_request(target_tokens=dense, weights=bf16, extra=sparse))
    inputs = call.data[0].loss_inputs
    assert call.data[0].tokens.tolist() == [1, 2, 3]
    assert (
        inputs["target_tokens"].tolist() == [4, 5, 6]
        and inputs["target_tokens"].dtype == torch.int64
    )
    assert inputs["weights"].tolist() == [0.5, 1.0, -2.0]
    assert inputs["extra"].tolist() == [[0.0, 1.5], [0.0, 0.0], [2.5, 0.0]]


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (
            pb.Tensor(dense=b"\x00" * 7, dtype=pb.DTYPE_FLOAT32),
            "7 bytes of float32 data, not a multiple of 4",
        ),
        (
            pb.Tensor(dense=b"\x00" * 8, dtype=pb.DTYPE_FLOAT32, shape=[3]),
            "2 float32 values but its shape [3] needs 3",
        ),
        (pb.Tensor(dense=b"", dtype=pb.DTYPE_UNSPECIFIED), "dtype enum 0"),
        (
            pb.Tensor(
                dtype=pb.DTYPE_FLOAT32,
                shape=[2, 2],
                sparse_csr=pb.SparseCsr(crow_indices=np.array([0, 1], dtype="<i8").tobytes()),
            ),
            "crow_indices has 2 entries",
        ),
    ],
)
def test_decode_errors_name_the_field(tensor, message):
    with pytest.raises(UserError) as info:
        proto.decode_call(_request(weights=tensor))
    assert "data[0].loss_fn_inputs['weights']" in str(info.value) and message in str(info.value)


def test_decode_envelope_errors():
    with pytest.raises(UserError, match="not a valid protobuf"):
        proto.parse_forward_backward(b"\x0a\xff\xff")
    with pytest.raises(UserError, match="seq_id must be >= 1"):
        proto.parse_forward_backward(pb.ForwardBackwardRequest(model_id="m").SerializeToString())
    msg = _request()
    msg.data[0].model_input.add().image.data = b"png"
    with pytest.raises(UserError, match=r"data\[0\].model_input.chunks\[1\] is a image chunk"):
        proto.decode_call(msg)


def test_outputs_decode_with_the_sdk():
    logprobs = [
        torch.tensor([-1.0, -2.0]),
        torch.tensor([-3.0]),
        torch.tensor([[-1.0, -4.0], [-2.0, -5.0]]),
    ]
    body = responses.forward_backward_output(logprobs, {"loss:sum": 3.0})
    out = response_conv.deserialize_forward_backward_output(body)
    assert out.metrics == {"loss:sum": 3.0}
    assert [o["logprobs"].shape for o in out.loss_fn_outputs] == [[2], [1], [2, 2]]
    assert out.loss_fn_outputs[2]["logprobs"].to_numpy().tolist() == [[-1.0, -4.0], [-2.0, -5.0]]

    result = SampleResult(
        sequences=[
            SampledSequence(
                [5, 6],
                [-0.5, -0.25],
                "length",
                None,
                topk_logprobs=[[(5, -0.5)], [(6, -0.25), (7, -2.0)]],
            )
        ],
        adapter=None,
        prompt_logprobs=[None, -1.0, -2.0],
        topk_prompt_logprobs=[None, [(1, -1.0)], [(2, -2.0)]],
    )
    body = responses.sample_response(
        result, prompt_logprobs=True, topk_prompt=2, topk_sample=2, last_n=1
    )
    response = response_conv.deserialize_sample_response(body)
    seq = response.sequences[0]
    assert seq.tokens == [5, 6] and seq.stop_reason == "length" and seq.logprobs == [-0.5, -0.25]
    assert response.prompt_logprobs == [None, None, -2.0]  # last_n=1 blanks the rest


def test_keys_and_tenants(tmp_path):
    with pytest.raises(ValueError, match="does not start with 'tml-'"):
        parse_keys(["sk-123456789"], "test")
    key_file = tmp_path / "keys"
    key_file.write_text("# comment\ntml-from-file-123456\n")
    keys = load_keys(
        key_file, env={"LORAFLEET_API_KEYS": "tml-from-env-1234567, tml-second-1234567"}
    )
    assert keys == ["tml-from-env-1234567", "tml-second-1234567", "tml-from-file-123456"]
    ring = KeyRing(keys)
    tenants = {ring.authenticate(k).id for k in keys}
    assert len(tenants) == 3 and ring.authenticate(keys[0]) == KeyRing(keys[:1]).authenticate(
        keys[0]
    )
    with pytest.raises(Unauthorized):
        ring.authenticate("tml-from-env-1234568")
    with pytest.raises(ValueError, match="no API keys"):
        load_keys(None, env={})


def test_tinker_paths():
    path = parse_tinker_path("tinker://abc-1:train:0/weights/step_10")
    assert (path.model_id, path.kind, path.checkpoint_id) == (
        "abc-1:train:0",
        "training",
        "weights/step_10",
    )
    assert run_dir_name(path.model_id) == "abc-1.train.0"
    for bad in (
        "s3://x/weights/a",
        "tinker://x/weights",
        "tinker://x/other/a",
        "tinker://x/weights/..",
        "tinker://x/weights/a b",
    ):
        with pytest.raises(UserError):
            parse_tinker_path(bad)


class _Recorder:
    def __init__(self):
        self.calls: list[tuple[str, list[tuple[str | None, int | None]]]] = []

    def _record(self, name, ops):
        self.calls.append((name, [(op.model_id, op.seq_id) for op in ops]))
        return [Result.json({"ok": True}) for _ in ops]

    def run_control(self, op):
        return self._record("control", [op])[0]

    def run_train(self, chunks):
        return self._record("train", [chunk.job for chunk in chunks])

    def run_optim(self, ops):
        return self._record("optim", ops)

    def run_sample(self, ops):
        return self._record("sample", ops)


class _Futures:
    def __init__(self):
        self.done: dict[str, Result] = {}
        self.event = threading.Event()

    def complete(self, request_id, result):
        self.done[request_id] = result
        self.event.set()


def test_scheduler_orders_by_seq_and_batches_across_models():
    recorder, futures = _Recorder(), _Futures()
    scheduler = Scheduler(futures)  # type: ignore[arg-type]
    scheduler.register_model("a")
    scheduler.register_model("b")
    scheduler.pause()
    scheduler.start(lambda: recorder)
    try:
        # chunks arrive out of order (the SDK sends the first one last)
        for model, seq, kind in [
            ("a", 3, "optim_step"),
            ("a", 2, "forward_backward"),
            ("b", 2, "optim_step"),
            ("a", 1, "forward_backward"),
            ("b", 1, "forward"),
            ("a", 5, "forward_backward"),
        ]:
            scheduler.submit(job(f"{model}{seq}", kind, "t", model_id=model, seq_id=seq))
        scheduler.resume()
        for _ in range(100):
            if len(futures.done) == 5:
                break
            futures.event.wait(0.1)
            futures.event.clear()
        assert recorder.calls == [
            ("train", [("a", 1), ("a", 2), ("b", 1)]),
            ("optim", [("a", 3), ("b", 2)]),
        ]
        assert "a5" not in futures.done  # seq 4 never came
        scheduler.submit(job("a1-again", "optim_step", "t", model_id="a", seq_id=1))
        assert futures.done["a1-again"].failed
        assert b"already executed" in futures.done["a1-again"].body
        assert (
            scheduler.stats.mixed_batches["forward_backward"] == 1
            and scheduler.stats.mixed_batches["optim_step"] == 1
        )
    finally:
        scheduler.stop()


def test_scheduler_skips_a_seq_that_never_arrives():
    """After the gap timeout the missing seq_id is skipped: what waited behind it runs, later
    seq_ids run at once, and the missing one arriving late fails saying why."""
    recorder, futures = _Recorder(), _Futures()
    scheduler = Scheduler(futures, gap_timeout_s=0.05)  # type: ignore[arg-type]
    scheduler.register_model("a")
    scheduler.start(lambda: recorder)
    try:
        scheduler.submit(job("a3", "optim_step", "t", model_id="a", seq_id=3))
        assert futures.event.wait(5.0)
        assert not futures.done["a3"].failed
        assert recorder.calls == [("optim", [("a", 3)])]
        futures.event.clear()
        scheduler.submit(job("a4", "optim_step", "t", model_id="a", seq_id=4))
        assert futures.event.wait(5.0) and not futures.done["a4"].failed
        for late in (1, 2):
            scheduler.submit(job(f"a{late}", "optim_step", "t", model_id="a", seq_id=late))
            assert futures.done[f"a{late}"].failed
            assert (
                b"arrived after the server gave up waiting for it" in futures.done[f"a{late}"].body
            )
    finally:
        scheduler.stop()


def test_the_scheduler_builds_its_executor_on_the_worker_and_hands_it_back():
    futures = _Futures()
    scheduler = Scheduler(futures)  # type: ignore[arg-type]
    built_on: list[str] = []

    def build() -> _Recorder:
        built_on.append(threading.current_thread().name)
        return _Recorder()

    try:
        executor = scheduler.start(build).result(timeout=10)
        assert isinstance(executor, _Recorder) and built_on == ["lorafleet-engine"]
    finally:
        scheduler.stop()

    def broken() -> _Recorder:
        raise RuntimeError("no model here")

    failing = Scheduler(futures)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="no model here"):
        failing.start(broken).result(timeout=10)
    assert failing.call(lambda: None).exception() is not None  # the worker stopped


def test_ephemeral_retention_numbers_per_model_and_evicts_the_oldest(tmp_path):
    root = tmp_path / "ephemeral"
    (root / "left-from-a-previous-run").mkdir(parents=True)
    retention = EphemeralRetention(root, keep=2)
    assert not root.exists()  # nothing survives a restart
    assert [retention.next_version("s:train:1") for _ in range(3)] == [0, 1, 2]
    assert retention.next_version("s:train:2") == 0
    assert retention.directory("s:train:1", 2) == root / "s.train.1" / "2"
    evicted = [retention.retain("s:train:1", ("m#live", v), root / str(v)) for v in range(3)]
    assert evicted == [[], [], [(("m#live", 0), root / "0")]]
    memory_only = EphemeralRetention(tmp_path / "none", keep=0)
    assert memory_only.directory("s:train:1", 0) is None and memory_only.limit == 1
    assert memory_only.retain("a", ("a#live", 0), None) == []
    assert memory_only.retain("a", ("a#live", 1), None) == [(("a#live", 0), None)]

"""The server-side pieces the battery relies on, one by one: start-up repair of the data dir,
the test-only crash points, and the decoders' guards against hostile bodies."""

from __future__ import annotations

import threading
import time

import pytest
import zstandard

from lorafleet.server.engine import faults
from lorafleet.server.errors import UserError
from lorafleet.server.http import schemas
from lorafleet.server.http.parse import unzstd
from lorafleet.server.ops.futures import FutureTable
from lorafleet.server.ops.scheduler import MAX_SEQ_AHEAD, Scheduler
from lorafleet.server.state import recovery
from lorafleet.server.state.store import CheckpointRow, Store
from tests.server.jobs import job


def _row(path: str, directory) -> CheckpointRow:
    return CheckpointRow(
        path,
        "t1",
        "m1",
        "training",
        path.rsplit("/", 1)[1],
        str(directory),
        time.time(),
        1,
        None,
        None,
        {},
    )


def test_sweep_repairs_what_a_crash_leaves_behind(tmp_path):
    store = Store(tmp_path / "db.sqlite")
    weights = tmp_path / "tenants" / "t1" / "runs" / "m1" / "weights"
    for name in (
        "keep",
        "orphan",
        ".keep.x1y2.tmp",
        ".keep.old-abc123",
        ".gone.old-def456",
        ".dead.deleted-0a0b0c",
    ):
        (weights / name).mkdir(parents=True)
        (weights / name / "state.json").write_text("{}")
    (weights / ".state.json.q9.tmp").write_text("half")  # a temp file, not a directory
    for name in ("keep", "gone", "missing"):
        store.checkpoints.put(_row(f"tinker://m1/weights/{name}", weights / name))
    counts = recovery.sweep(tmp_path, store)
    assert sorted(p.name for p in weights.iterdir()) == ["gone", "keep"]
    assert (weights / "gone" / "state.json").read_text() == "{}"  # the set-aside copy came back
    assert counts == {
        "temp_removed": 3,
        "asides_restored": 1,
        "asides_removed": 1,
        "orphans_removed": 1,
        "missing_dirs": 1,
    }
    assert recovery.sweep(tmp_path, store)["orphans_removed"] == 0  # idempotent
    store.close()


def test_crash_points_announce_and_pause_only_where_asked(tmp_path):
    assert not faults.enabled()  # off unless LORAFLEET_FAULT_FILE is set at start-up
    faults.point("save_state.begin")  # a no-op
    log = tmp_path / "faults.log"
    recorder = faults._Recorder(str(log))
    recorder.hit("save_state.begin")
    recorder.hit("optim_step.end")
    (tmp_path / "faults.log.pause").write_text("save_state.begin 2\n")
    blocked = threading.Thread(target=recorder.hit, args=("save_state.begin",), daemon=True)
    blocked.start()  # the second hit pauses (for good: the thread is left behind, as a daemon)
    blocked.join(1.0)
    assert blocked.is_alive()
    lines = [line.split() for line in log.read_text().splitlines()]
    assert [line[:2] for line in lines] == [
        ["save_state.begin", "1"],
        ["optim_step.end", "1"],
        ["save_state.begin", "2"],
    ]
    assert lines[-1][-1] == "paused" and lines[0][-1] != "paused"


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"[" * 100_000, "nested too deeply"),
        (b'{"a": ' + b"1" * 5000 + b"}", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"{", "not valid JSON"),
    ],
)
def test_hostile_json_is_a_user_error(raw, message):
    with pytest.raises(UserError, match=message):
        schemas.parse_json(raw)


def test_integers_that_would_overflow_the_store_are_refused():
    for value in (2**63, -1, 0):
        with pytest.raises(UserError, match="seq_id"):
            schemas.parse(schemas.OptimStep, {"model_id": "m", "seq_id": value, "adam_params": {}})
    with pytest.raises(UserError, match="ttl_seconds"):
        schemas.parse(
            schemas.SaveWeights, {"model_id": "m", "seq_id": 1, "path": "p", "ttl_seconds": 10**12}
        )
    assert (
        schemas.parse(
            schemas.OptimStep, {"model_id": "m", "seq_id": 2**63 - 1, "adam_params": {}}
        ).seq_id
        == 2**63 - 1
    )


def test_zstd_bodies_are_bounded_by_what_they_expand_to():
    small = zstandard.ZstdCompressor().compress(b"abc" * 1000)
    assert unzstd(small, 1 << 20) == b"abc" * 1000
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (32 << 20))  # ~1 KB on the wire
    with pytest.raises(UserError, match="decompresses to more than") as caught:
        unzstd(bomb, 1 << 20)
    assert caught.value.status == 413
    with pytest.raises(UserError, match="not valid zstd"):
        unzstd(b"definitely not zstd", 1 << 20)


def test_a_seq_id_far_past_the_next_one_fails_at_once(tmp_path):
    store = Store(tmp_path / "db.sqlite")
    futures = FutureTable(store)
    scheduler = Scheduler(futures)  # never started: submit alone decides
    scheduler.register_model("m", next_seq=5)
    for request_id, seq in (("far", 5 + MAX_SEQ_AHEAD + 1), ("near", 5 + MAX_SEQ_AHEAD)):
        futures.create(request_id, "t", kind="optim_step", scope="m", seq_id=seq)
        scheduler.submit(job(request_id, "optim_step", "t", model_id="m", seq_id=seq))
    far = store.futures.get("far")
    assert far.state == "failed" and b"ahead of the next one" in far.body
    assert store.futures.get("near").state == "pending" and scheduler.pending() == 1
    store.close()


def test_a_retried_ephemeral_save_gets_its_first_attempts_future(tmp_path):
    """The SDK retries save_weights_and_get_sampling_client with a new sampling_session_seq_id
    (found by the crash battery: a kill before the first answer reached the client turned the
    retry into a 400 'different request')."""
    from tests.reliability.fuzz import Raw, set_up_tenant
    from tests.reliability.harness import inprocess_server, tenant_keys

    key = tenant_keys(1, "units")[0]
    with inprocess_server(tmp_path / "data", [key]) as server:
        raw = Raw(server.base_url, key)
        t = set_up_tenant(raw, "tiny-qwen3", models=1)
        model = t.own_models[0]
        seq = t.next_seq[model]
        first = raw.post(
            "save_weights_for_sampler",
            {"model_id": model, "seq_id": seq, "sampling_session_seq_id": 5},
        )
        again = raw.post(
            "save_weights_for_sampler",
            {"model_id": model, "seq_id": seq, "sampling_session_seq_id": 6},
        )
        assert again["request_id"] == first["request_id"]
        result = raw.done(first)
        assert result["sampling_session_id"].endswith(":sample:5")
        other = raw.client.post(
            "save_weights_for_sampler", json={"model_id": model, "seq_id": seq, "path": "named"}
        )
        assert other.status_code == 400 and "different request" in other.json()["error"]
        raw.close()


def test_a_sparse_tensor_cannot_declare_gigabytes():
    """A few hundred bytes of CSR row pointers declaring [16384, 16384] (1 GiB once dense)."""
    import numpy as np
    from tinker.proto import tinker_public_pb2 as pb

    from lorafleet.server.http import proto

    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.arange(1, 5, dtype="<i4").tobytes()
    weights = datum.loss_fn_inputs["weights"]
    weights.dtype = pb.DTYPE_FLOAT32
    weights.shape.extend([16384, 16384])
    weights.sparse_csr.crow_indices = np.zeros(16385, dtype="<i8").tobytes()
    with pytest.raises(UserError, match=r"sparse CSR of shape \[16384, 16384\], more than"):
        proto.decode_call(msg)
    small = datum.loss_fn_inputs["targets"]
    small.dtype = pb.DTYPE_FLOAT32
    small.shape.extend([4, 3])
    small.sparse_csr.crow_indices = np.zeros(5, dtype="<i8").tobytes()
    del datum.loss_fn_inputs["weights"]
    assert proto.decode_call(msg).data[0].loss_inputs["targets"].shape == (4, 3)

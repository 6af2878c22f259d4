"""Big requests: one sample request at the server's caps (the largest it accepts) must not take
the server's memory, and requests over the caps are refused before any work, with an error that
names the field, the value and the limit.

The server runs as a child process, so its memory is its own: the report's
`peak_rss_growth_mb` is the child's peak resident set (VmHWM, reset through
/proc/<pid>/clear_refs just before the request where the kernel allows it) minus its resident
set before the request. The caps are read back from `get_server_capabilities`
(`lorafleet_limits`), and the request at the caps is built from them: the most top-k entries
allowed, and as many samples as the response budget leaves room for.

`python -m tests.reliability.big_request serve DATA_DIR PORT OVERRIDES_JSON` is the child (keys
in $LORAFLEET_API_KEYS): a `lorafleet serve` whose ServerConfig takes the overrides, so a test
can run the scenario with small caps and the bench with the defaults.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import tinker
from tinker import types

from lorafleet.server.http.parse import SEQUENCE_BYTES, TOKEN_BYTES, TOPK_ENTRY_BYTES
from lorafleet.server.main import free_port
from tests.reliability.harness import BASE_MODEL, REPO, server_config, tenant_keys

PROMPT = [1, 2, 3, 4]
RESULT_TIMEOUT_S = 900.0
REFUSED_GROWTH_MB = 16.0  # refusals parse a small JSON body; anything more is work done


def _status_mb(pid: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            out[key] = int(value.split()[0]) / 1024
    return out


def _reset_peak(pid: int) -> bool:
    """Sets VmHWM back to the current RSS (Linux >= 4.0); False where that is not allowed, and
    the growth is then measured from the older, higher peak (an over-estimate)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class _Child:
    """The server process; `peak_growth_mb` brackets one stretch of requests."""

    def __init__(self, data_dir: Path, keys: list[str], log_path: Path, overrides: dict[str, Any]):
        self.port = free_port()
        self.log_path = log_path
        env = {
            **os.environ,
            "LORAFLEET_API_KEYS": ",".join(keys),
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",
        }
        command = [
            sys.executable, "-m", "tests.reliability.big_request", "serve", str(data_dir),
            str(self.port), json.dumps(overrides),
        ]  # fmt: skip
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT
            )
        began = time.monotonic()
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/api/v1/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() - began > 180:
                self.stop()
                raise RuntimeError(f"the server did not come up:\n{self.log_tail()}")
            time.sleep(0.1)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def start_window(self) -> tuple[float, bool]:
        reset = _reset_peak(self.process.pid)
        return _status_mb(self.process.pid)["VmRSS"], reset

    def peak_growth_mb(self, rss_before: float) -> float:
        return _status_mb(self.process.pid)["VmHWM"] - rss_before

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)


@dataclass(frozen=True)
class Shape:
    num_samples: int
    max_tokens: int
    topk: int

    def response_bytes(self) -> int:
        """As the server estimates it (requests.response_bytes) for a request that asks for no
        prompt logprobs."""
        per_token = TOKEN_BYTES + self.topk * TOPK_ENTRY_BYTES
        return self.num_samples * (SEQUENCE_BYTES + self.max_tokens * per_token)


def largest_shape(
    limits: dict[str, int], context: int, max_tokens: int | None, topk: int | None = None
) -> Shape:
    """The largest request the caps allow: `topk` entries per token (default: the cap),
    `max_tokens` (default: the whole context after the prompt), and as many samples as the
    budget holds."""
    topk = limits["max_topk_logprobs"] if topk is None else topk
    tokens = max_tokens if max_tokens is not None else context - len(PROMPT)
    per_sample = Shape(1, tokens, topk).response_bytes()
    samples = min(limits["max_num_samples"], limits["max_response_bytes"] // per_sample)
    if samples < 1:
        raise ValueError(f"max_tokens {tokens} leaves room for no sample under {limits}")
    return Shape(samples, tokens, topk)


def _over_caps(shape: Shape, limits: dict[str, int], context: int) -> list[tuple[str, Shape]]:
    """(field the error must name, request) for requests just over each cap."""
    out = [("topk_sample_logprobs", Shape(1, 1, limits["max_topk_logprobs"] + 1))]
    if shape.num_samples < limits["max_num_samples"]:
        out.append(("bytes", Shape(shape.num_samples + 1, shape.max_tokens, shape.topk)))
    else:
        tokens = min(context - len(PROMPT), shape.max_tokens * 2)
        out.append(("bytes", Shape(shape.num_samples, tokens, shape.topk)))
    return out


def _complete(seq: Any, topk: int) -> bool:
    """A logprob per token, and `topk` entries per token when they were asked for."""
    if len(seq.logprobs or []) != len(seq.tokens):
        return False
    if not topk:
        return not seq.topk_logprobs
    rows = seq.topk_logprobs or []
    return len(rows) == len(seq.tokens) and all(len(row) == topk for row in rows)


def _sample(client: Any, shape: Shape, temperature: float = 1.0) -> Any:
    params = types.SamplingParams(max_tokens=shape.max_tokens, temperature=temperature, seed=7)
    return client.sample(
        types.ModelInput.from_ints(PROMPT),
        shape.num_samples,
        params,
        topk_sample_logprobs=shape.topk,
    ).result(timeout=RESULT_TIMEOUT_S)


def run_big_request(
    tmp_path: Path,
    *,
    overrides: dict[str, Any] | None = None,
    max_tokens: int | None = None,
    topk: int | None = None,
) -> dict[str, Any]:
    """Returns the report; `peak_rss_growth_mb` for the request at the caps, `over_cap_refused`
    when every request over a cap failed naming its field and the limit, with no growth."""
    keys = tenant_keys(1, "big")
    tmp_path.mkdir(parents=True, exist_ok=True)
    child = _Child(tmp_path / "data", keys, tmp_path / "server.log", overrides or {})
    try:
        caps = httpx.get(
            f"{child.base_url}/api/v1/get_server_capabilities",
            headers={"X-API-Key": keys[0]},
            timeout=30,
        ).json()
        limits: dict[str, int] = caps["lorafleet_limits"]
        context = int(caps["supported_models"][0]["max_context_length"])
        shape = largest_shape(limits, context, max_tokens, topk)
        service = tinker.ServiceClient(base_url=child.base_url, api_key=keys[0])
        try:
            client = service.create_sampling_client(base_model=BASE_MODEL).result(timeout=60)
            _sample(client, Shape(2, 8, 2))  # warm-up: lazy allocations are not the request's
            rss_before, reset = child.start_window()
            began = time.monotonic()
            response = _sample(client, shape)
            seconds = time.monotonic() - began
            growth = child.peak_growth_mb(rss_before)
            complete = len(response.sequences) == shape.num_samples and all(
                _complete(seq, shape.topk) for seq in response.sequences
            )
            sampled_tokens = sum(len(seq.tokens) for seq in response.sequences)
            del response
            refusals: dict[str, str] = {}
            problems: list[str] = []
            rss_before_refusals, _ = child.start_window()
            for field, over in _over_caps(shape, limits, context):
                try:
                    _sample(client, over)
                    problems.append(f"{over} over the {field} cap was accepted")
                except tinker.RequestFailedError as exc:
                    message = str(exc)
                    refusals[field] = message
                    limit = (
                        limits["max_response_bytes"]
                        if field == "bytes"
                        else limits["max_topk_logprobs"]
                    )
                    if field not in message or str(limit) not in message:
                        problems.append(f"{over}: the error does not name {field} and {limit}")
            metadata_refused = _metadata_refused(service, limits, refusals, problems)
            refused_growth = child.peak_growth_mb(rss_before_refusals)
        finally:
            service.close("success").result(timeout=60)
    finally:
        child.stop()
    if refused_growth > REFUSED_GROWTH_MB:
        problems.append(f"refused requests grew the server by {refused_growth:.1f} MB")
    return {
        "limits": limits,
        "shape": {
            "num_samples": shape.num_samples,
            "max_tokens": shape.max_tokens,
            "topk": shape.topk,
        },
        "estimated_response_bytes": shape.response_bytes(),
        "sampled_tokens": sampled_tokens,  # fewer than samples x max_tokens where one stopped
        "response_bytes": sampled_tokens * (TOKEN_BYTES + shape.topk * TOPK_ENTRY_BYTES),
        "complete": complete,
        "seconds": round(seconds, 2),
        "peak_rss_growth_mb": round(growth, 1),
        "peak_reset": reset,
        "refused_growth_mb": round(refused_growth, 1),
        "refusals": refusals,
        "over_cap_refused": not problems and metadata_refused,
        "problems": problems,
    }


def _metadata_refused(
    service: Any, limits: dict[str, int], refusals: dict[str, str], problems: list[str]
) -> bool:
    """user_metadata one key or one byte over its caps is refused at create_model."""
    too_many = {f"k{i}": "v" for i in range(limits["max_metadata_keys"] + 1)}
    too_big = {"note": "x" * limits["max_metadata_bytes"]}
    refused = True
    for label, metadata, limit in (
        ("keys", too_many, limits["max_metadata_keys"]),
        ("bytes", too_big, limits["max_metadata_bytes"]),
    ):
        try:
            service.create_lora_training_client(
                base_model=BASE_MODEL, rank=4, user_metadata=metadata
            ).result(timeout=60)
            problems.append(f"user_metadata over the {label} cap was accepted")
            refused = False
        except (tinker.BadRequestError, tinker.RequestFailedError) as exc:
            message = str(exc)
            refusals[f"user_metadata_{label}"] = message
            if "user_metadata" not in message or str(limit) not in message:
                problems.append(f"user_metadata over {label}: the error does not name the limit")
                refused = False
    return refused


def _serve(data_dir: str, port: str, overrides: str) -> None:
    from lorafleet.server.main import serve

    config = server_config(
        Path(data_dir), os.environ["LORAFLEET_API_KEYS"].split(","), **json.loads(overrides)
    )
    config.port = int(port)
    serve(config, log_level="warning")


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[1] != "serve":
        raise SystemExit(__doc__)
    _serve(*sys.argv[2:])

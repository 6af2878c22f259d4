"""What an open console page costs a training step.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.console --json bench/results/console.json

One in-process server (tiny-qwen3 by default, `--base-model`), one tenant training one run with
the official `tinker` SDK over loopback: a timed block is `--steps` (10) steps of
forward_backward (`--rows` rows of `--tokens` tokens) + optim_step. Two sides, interleaved
round after round (`--repeats`, min and median per side):

- `no_page`: no console page open (the browser's tab is on about:blank);
- `stream_only`: the server's side alone: a client in a process of its own, signed in and
  reading the same event stream as the page (no browser);
- `page_open`: a headless Chromium tab (Debian's /usr/bin/chromium, driven by Playwright)
  signed in to `/console` with the run selected, so its event stream re-reads the overview
  and the run's curve every `--refresh-s` (the server's default, 1 s) and redraws the chart
  as each step's loss arrives.

`page_overhead` = page_open / no_page over the min times (median beside it); target < 1.05.
`stream_overhead` = stream_only / no_page: what the server spends on the stream itself.
The browser runs in its own processes, on the same CPUs as the server: on a small machine
its rendering competes with the engine, which the ratio includes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import psutil
import tinker
from tinker import types

from bench.common import fixed_dtype, parse_args, report
from lorafleet.engines import EngineConfig
from lorafleet.server.config import ServerConfig
from lorafleet.server.main import ServerThread, free_port

CHROMIUM = Path("/usr/bin/chromium")
KEY = "tml-bench-console-0123456789"
T = TypeVar("T")


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def main() -> None:
    args = parse_args(
        __doc__ or "",
        with_device=False,
        with_dtype=False,
        base_model=(str, "tiny-qwen3", "the server's base model (a preset or a local dir)"),
        steps=(int, 10, "training steps per timed block"),
        rows=(int, 4, "rows per forward_backward"),
        tokens=(int, 64, "tokens per row"),
        refresh_s=(float, 1.0, "the console's refresh interval (ServerConfig.console_refresh_s)"),
    )
    from playwright.sync_api import sync_playwright

    if not CHROMIUM.exists():
        raise SystemExit(f"{CHROMIUM} is missing: apt-get install -y chromium")
    dtype = fixed_dtype("float32", "the server's default base dtype (EngineConfig)")
    data = [
        _datum([(7 * r + 3 * i) % 500 + 1 for i in range(args.tokens)]) for r in range(args.rows)
    ]
    pool = ThreadPoolExecutor(1)  # SDK calls off Playwright's event loop

    def off_loop(fn: Callable[[], T]) -> T:
        return pool.submit(fn).result()

    with tempfile.TemporaryDirectory() as tmp:
        config = ServerConfig(
            base_model=args.base_model,
            data_dir=Path(tmp) / "data",
            api_keys=[KEY],
            port=free_port(),
            engine=EngineConfig(base_model=args.base_model, max_adapters=4, sampler_slots=2),
            torch_threads=1,
            batch_window_s=0.0,
            tokenizer_cache=Path(tmp) / "hub",
            console_refresh_s=args.refresh_s,
        )
        server = ServerThread(config)
        try:
            sc = off_loop(lambda: tinker.ServiceClient(base_url=server.base_url, api_key=KEY))
            tc = off_loop(
                lambda: sc.create_lora_training_client(args.base_model, rank=8, seed=0).result()
            )

            def block() -> None:
                for _ in range(args.steps):
                    fb = tc.forward_backward(data, "cross_entropy")
                    opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
                    fb.result()
                    opt.result()

            with sync_playwright() as pw:
                browser = pw.chromium.launch(
                    executable_path=str(CHROMIUM),
                    args=["--no-sandbox"] if os.geteuid() == 0 else [],
                )
                page = browser.new_page()

                def open_page() -> None:
                    page.goto(f"{server.base_url}/console")
                    page.wait_for_selector("body[data-ready]")
                    if page.is_visible("#signin-view"):
                        page.fill("#key", KEY)
                        page.click("#signin button[type=submit]")
                    page.click(f"#runs tr[data-run='{tc.model_id}']")
                    page.wait_for_selector(
                        "#curve path[data-series='loss/server']", state="attached"
                    )

                reader = StreamReader(server.base_url, KEY, tc.model_id)

                def no_page() -> None:
                    reader.stop()
                    page.goto("about:blank")

                def stream_only() -> None:
                    page.goto("about:blank")
                    reader.start()

                def page_open() -> None:
                    reader.stop()
                    open_page()

                sides: dict[str, Callable[[], None]] = {
                    "no_page": no_page,
                    "stream_only": stream_only,
                    "page_open": page_open,
                }
                times: dict[str, list[float]] = {name: [] for name in sides}
                # CPU seconds per block: this process (the server, its engine, the SDK client)
                # and its children (Playwright's driver, Chromium, the stream reader): on a
                # loaded machine wall times are noisy, CPU time says what the console costs
                cpu: dict[str, dict[str, list[float]]] = {
                    name: {"server": [], "children": []} for name in sides
                }
                off_loop(block)  # warm-up: first steps allocate and compile
                open_page()
                for _ in range(args.repeats):
                    for name, setup in sides.items():
                        setup()
                        page.wait_for_timeout(1000)  # the page loaded and drawn, not timed
                        own, kids = _cpu()
                        start = time.perf_counter()
                        off_loop(block)  # the browser runs the page meanwhile, on its own
                        times[name].append(time.perf_counter() - start)
                        own_after, kids_after = _cpu()
                        cpu[name]["server"].append(own_after - own)
                        cpu[name]["children"].append(kids_after - kids)
                streams = server.service.console.streams.open_streams
                reader.stop()
                browser.close()
            off_loop(lambda: sc.close("success").result(timeout=30))
        finally:
            server.stop()
            pool.shutdown()
    timings = {name: _summary(values) for name, values in times.items()}
    per_step = {
        name: {k: (v / args.steps if k.endswith("_s") else v) for k, v in t.items()}
        for name, t in timings.items()
    }
    ratio = timings["page_open"]["min_s"] / timings["no_page"]["min_s"]
    ratio_median = timings["page_open"]["median_s"] / timings["no_page"]["median_s"]
    stream_ratio = timings["stream_only"]["min_s"] / timings["no_page"]["min_s"]
    report(
        f"console page overhead: {args.base_model}, {args.steps} steps of fwd+bwd {args.rows}x"
        f"{args.tokens} + optim_step per block, refresh {args.refresh_s:g} s",
        per_step,
        {
            "page_overhead": (ratio, "< 1.05 (page_open / no_page, min per step)"),
            "page_overhead_median": (ratio_median, "< 1.05 (medians)"),
            "stream_overhead": (stream_ratio, "the server's side alone: an SSE reader, no page"),
        },
        args.json,
        {
            "cpu_ms_per_step": {
                name: {part: 1e3 * sorted(v)[len(v) // 2] / args.steps for part, v in parts.items()}
                for name, parts in cpu.items()
            },
            "loadavg_at_end": os.getloadavg(),
            "steps_per_block": args.steps,
            "rows": args.rows,
            "tokens": args.tokens,
            "refresh_s": args.refresh_s,
            "streams_open_at_end": streams,
        },
        dtype=dtype,
    )


class StreamReader:
    """The server's side of an open page without the browser: a signed-in client reading the
    same event stream, in a process of its own as a browser would be (`stream_only`)."""

    def __init__(self, base_url: str, key: str, run: str):
        self.base_url, self.key, self.run = base_url, key, run
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _READER, self.base_url, self.key, self.run],
            stdout=subprocess.DEVNULL,
        )
        time.sleep(0.5)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None


_READER = """
import sys, httpx
base, key, run = sys.argv[1:]
with httpx.Client(base_url=base, timeout=None) as c:
    c.post("/console/api/session", json={"key": key}).raise_for_status()
    with c.stream("GET", f"/console/api/events?view=tenant&run={run}") as r:
        for line in r.iter_lines():
            pass
"""


def _cpu() -> tuple[float, float]:
    """(this process's CPU seconds, its live descendants' CPU seconds)."""
    me = psutil.Process()
    own = me.cpu_times()
    kids = 0.0
    for child in me.children(recursive=True):
        try:
            t = child.cpu_times()
        except psutil.NoSuchProcess:
            continue
        kids += t.user + t.system
    return own.user + own.system, kids


def _summary(values: list[float]) -> dict[str, Any]:
    ordered = sorted(values)
    return {"min_s": ordered[0], "median_s": ordered[len(ordered) // 2], "runs": len(values)}


if __name__ == "__main__":
    main()

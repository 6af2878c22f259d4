"""The console in a real browser: Playwright driving Debian's `chromium` against one server
(two tenants from a tenants file, alice an operator) while the real `tinker` SDK trains.

Each test saves a screenshot in its tmp_path and copies it to SHOTS (printed), so a reviewer
can look at what the browser showed. Skipped, naming the command, where chromium or
playwright is missing."""

from __future__ import annotations

import io
import os
import shutil
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest
import tinker
from tinker import types

from lorafleet.server.main import ServerThread
from tests.server.conftest import TRAIN_DATA
from tests.server.tenant_files import tenants_server_config, write_tenants

CHROMIUM = Path("/usr/bin/chromium")
SHOTS = Path("/tmp/lorafleet-console-shots")
ALICE = "tml-alice-console-0123456789"
BOB = "tml-bob-console-0123456789ab"
T = TypeVar("T")

sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed: bash scripts/setup.sh"
)
if not CHROMIUM.exists():
    pytest.skip(
        f"{CHROMIUM} is missing: run `apt-get install -y chromium` (scripts/setup.sh does, as root)",
        allow_module_level=True,
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerThread]:
    root = tmp_path_factory.mktemp("console")
    tenants = write_tenants(
        root / "tenants.toml",
        {"alice": {"keys": [ALICE], "operator": True}, "bob": {"keys": [BOB]}},
    )
    srv = ServerThread(tenants_server_config(root / "data", tenants, console_refresh_s=0.2))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser(server: ServerThread) -> Iterator[object]:
    with sync_api.sync_playwright() as pw:
        # --no-sandbox: chromium's sandbox refuses to start as root (CI containers)
        args = ["--no-sandbox"] if os.geteuid() == 0 else []
        b = pw.chromium.launch(executable_path=str(CHROMIUM), args=args)
        yield b
        b.close()


@pytest.fixture
def page(browser, server: ServerThread) -> Iterator[object]:
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    pg = context.new_page()
    pg.set_default_timeout(20_000)
    pg.on("dialog", lambda dialog: dialog.accept())
    yield pg
    context.close()


def shot(page, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    SHOTS.mkdir(parents=True, exist_ok=True)
    stable = SHOTS / f"{name}.png"
    shutil.copyfile(path, stable)
    print(f"screenshot: {path} (copy: {stable})")
    return path


def sign_in(page, server: ServerThread, key: str) -> None:
    page.goto(f"{server.base_url}/console")
    page.wait_for_selector("body[data-ready]")
    page.fill("#key", key)
    page.click("#signin button[type=submit]")
    page.wait_for_selector("#whoami:not([hidden])")


def off_loop(fn: Callable[[], T]) -> T:
    """Runs SDK calls on a thread of their own: Playwright's sync API keeps an event loop on
    the test's thread, where the SDK's blocking calls would warn (and block that loop)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result(timeout=120)


def new_run(server: ServerThread, key: str, steps: int = 1) -> tuple[tinker.ServiceClient, Any]:
    def make() -> tuple[tinker.ServiceClient, Any]:
        sc = tinker.ServiceClient(base_url=server.base_url, api_key=key)
        tc = sc.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=5).result()
        for _ in range(steps):
            tc.forward_backward(TRAIN_DATA, "cross_entropy").result()
        return sc, tc

    return off_loop(make)


def close(sc: tinker.ServiceClient) -> None:
    off_loop(lambda: sc.close("success").result(timeout=30))


def test_sign_in_keeps_no_key_in_the_browser(page, server: ServerThread, tmp_path: Path):
    page.goto(f"{server.base_url}/console")
    page.fill("#key", ALICE + "-wrong")
    page.click("#signin button[type=submit]")
    page.wait_for_selector("#signin-error:has-text('invalid API key')")
    sign_in(page, server, ALICE)
    assert page.inner_text("#whoami") == "tenant alice (operator)"
    assert ALICE not in page.content()
    assert ALICE not in page.url
    assert page.evaluate("document.cookie") == ""  # the session cookie is HttpOnly
    assert page.evaluate("localStorage.length + sessionStorage.length") == 0
    assert page.input_value("#key") == ""
    cookie = next(c for c in page.context.cookies() if c["name"] == "lorafleet_console")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/console"
    shot(page, tmp_path, "sign_in")
    page.click("#signout")
    page.wait_for_selector("#signin-view:not([hidden])")
    page.reload()
    page.wait_for_selector("body[data-ready]")
    assert page.is_visible("#signin-view") and page.is_hidden("#whoami")  # the cookie is dead


def test_own_runs_only(page, server: ServerThread, tmp_path: Path):
    sa, alice_run = new_run(server, ALICE)
    sb, bob_run = new_run(server, BOB)
    try:
        sign_in(page, server, BOB)
        page.wait_for_selector(f"#runs tr[data-run='{bob_run.model_id}']")
        listed = page.eval_on_selector_all("#runs tbody tr", "rows => rows.map(r => r.dataset.run)")
        assert bob_run.model_id in listed and alice_run.model_id not in listed
        assert alice_run.model_id not in page.content()
        assert page.get_attribute(f"#runs tr[data-run='{bob_run.model_id}']", "data-state") == "hot"
        assert page.is_hidden("#operator-tab")  # bob is no operator
        shot(page, tmp_path, "own_runs_only")
    finally:
        close(sa)
        close(sb)


def test_curve_gains_a_point_while_a_client_trains(page, server: ServerThread, tmp_path: Path):
    sc, tc = new_run(server, ALICE, steps=2)
    try:
        sign_in(page, server, ALICE)
        page.click(f"#runs tr[data-run='{tc.model_id}']")
        line = "#curve path[data-series='loss/server']"
        page.wait_for_selector(f"{line}[data-count='2']", state="attached")
        shot(page, tmp_path, "curve_before")
        trainer = threading.Thread(
            target=lambda: [
                tc.forward_backward(TRAIN_DATA, "cross_entropy").result(),
                tc.optim_step(types.AdamParams(learning_rate=0.05)).result(),
                tc.forward_backward(TRAIN_DATA, "cross_entropy").result(),
            ]
        )
        trainer.start()
        page.wait_for_selector(f"{line}[data-count='4']", state="attached")  # over SSE
        trainer.join(60)
        shot(page, tmp_path, "curve_after")
    finally:
        close(sc)


def test_change_ttl_and_delete_a_checkpoint(page, server: ServerThread, tmp_path: Path):
    sc, tc = new_run(server, ALICE)
    keep = off_loop(lambda: tc.save_weights_for_sampler("keep").result().path)
    gone = off_loop(lambda: tc.save_weights_for_sampler("gone").result().path)
    try:
        sign_in(page, server, ALICE)
        page.click(f"#runs tr[data-run='{tc.model_id}']")
        row = f"#checkpoints tr[data-path='{keep}']"
        page.wait_for_selector(f"{row} td.expires:has-text('never')")
        page.fill(f"{row} input.ttl-input", "3600")
        page.click(f"{row} button.ttl-set")
        page.wait_for_selector(f"{row} td.expires:not(:has-text('never'))")
        expires = server.service.store.checkpoints.get(keep).expires_at
        assert expires is not None and abs(expires - (time.time() + 3600)) < 120
        # the PEFT zip, fetched as the page's link would be (with the session cookie)
        href = page.get_attribute(f"{row} a.download", "href")
        archive = page.request.get(f"{server.base_url}{href}")
        assert archive.status == 200
        names = zipfile.ZipFile(io.BytesIO(archive.body())).namelist()
        assert "adapter_config.json" in names and "adapter_model.safetensors" in names
        page.click(f"#checkpoints tr[data-path='{gone}'] button.delete")
        page.wait_for_selector(f"#checkpoints tr[data-path='{gone}']", state="detached")
        listed = off_loop(
            lambda: [
                c.tinker_path
                for c in tinker.RestClient(base_url=server.base_url, api_key=ALICE)
                .list_checkpoints(tc.model_id)
                .result()
                .checkpoints
            ]
        )
        assert keep in listed and gone not in listed
        shot(page, tmp_path, "ttl_and_delete")
    finally:
        close(sc)


def test_operator_view_lists_both_tenants(page, server: ServerThread, tmp_path: Path):
    sb, _ = new_run(server, BOB)  # bob has usage to show
    try:
        sign_in(page, server, ALICE)
        page.click("#operator-tab")
        page.wait_for_selector("#op-tenants tr[data-tenant='alice']")
        page.wait_for_selector("#op-tenants tr[data-tenant='bob']")
        assert page.is_visible("#op-tenants tfoot th:has-text('total')")
        assert "hot" in page.inner_text("#tiers")
        shot(page, tmp_path, "operator_view")
    finally:
        close(sb)


def test_an_operator_flag_removed_by_a_reload_leaves_the_operator_view(
    page, server: ServerThread, tmp_path: Path
):
    """The open operator stream is refused at its next snapshot; the page goes back to the
    tenant's own view and hides the operator tab instead of keeping stale fleet data."""
    tenancy = server.service.tenancy
    assert tenancy.path is not None
    before = tenancy.path.read_text()
    sign_in(page, server, ALICE)
    page.click("#operator-tab")
    page.wait_for_selector("#op-tenants tr[data-tenant='alice']")
    try:
        tenancy.path.write_text(before.replace("operator = true", "operator = false"))
        tenancy.reload()
        page.wait_for_selector("#operator-view", state="hidden")
        assert page.is_hidden("#operator-tab") and page.is_visible("#tenant-view")
        assert page.inner_text("#whoami") == "tenant alice"
        shot(page, tmp_path, "operator_demoted")
    finally:
        tenancy.path.write_text(before)
        tenancy.reload()

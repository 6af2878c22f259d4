"""Issue 34, item 8: an archive (or external-weights) link names one save of a checkpoint, so a
checkpoint deleted and saved again under the same name, or overwritten, never answers a link
made before; and links and redirects name the configured public address, never the request's
`Host` header."""

from __future__ import annotations

from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import httpx
import pytest
import tinker

from tests.server.conftest import KEY_A, trained


def _archive_url(server, path: str) -> str:
    run, segment, name = path.removeprefix("tinker://").split("/")
    return f"{server.base_url}/api/v1/training_runs/{run}/checkpoints/{segment}/{name}/archive"


def _link(server, path: str, **headers: str) -> str:
    answer = httpx.get(_archive_url(server, path), headers={"X-API-Key": KEY_A, **headers})
    assert answer.status_code == 302, answer.text
    return answer.headers["location"]


def test_a_resaved_checkpoint_never_answers_an_old_link(server, client_a, base_model):
    tc = trained(client_a, base_model, seed=34)
    rest = tinker.RestClient(base_url=server.base_url, api_key=KEY_A)
    for save in (tc.save_weights_for_sampler, tc.save_state):
        path = save("resaved").result().path
        old = _link(server, path)
        assert httpx.get(old).status_code == 200
        rest.delete_checkpoint_from_tinker_path(path).result()
        assert save("resaved").result().path == path  # same name, a new checkpoint
        stale = httpx.get(old)
        assert stale.status_code == 404, stale.text
        assert "saved again" in stale.text
        fresh = _link(server, path)
        assert fresh != old and httpx.get(fresh).status_code == 200
        # the version a link carries is under its signature: re-aimed at the new save, it fails
        parts = urlsplit(old)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        query["version"] = parse_qs(urlsplit(fresh).query)["version"][0]
        forged = urlunsplit(parts._replace(query=urlencode(query)))
        assert httpx.get(forged).status_code == 403


def test_links_name_the_configured_address_not_the_host_header(server, client_a, base_model):
    tc = trained(client_a, base_model, seed=35)
    path = tc.save_weights_for_sampler("hosted").result().path
    link = _link(server, path, Host="attacker.example:9999")
    assert link.startswith(server.base_url + "/"), link
    assert "attacker" not in link
    xpath = tc.save_weights_external("hosted-x").result().path
    xrun, _, xname = xpath.removeprefix("tinker://").split("/")
    urls = httpx.get(
        f"{server.base_url}/api/v1/training_runs/{xrun}/checkpoints/external_weights/"
        f"{xname}/external_weights_urls",
        headers={"X-API-Key": KEY_A, "Host": "attacker.example"},
    ).json()["urls"]
    assert urls and all(u.startswith(server.base_url + "/") for u in urls.values())
    assert all(httpx.get(u).status_code == 200 for u in urls.values())


def test_public_url_is_validated_and_used():
    from lorafleet.server.http.public_url import check_public_url, public_base_url

    assert public_base_url("https://tinker.example.com/", "0.0.0.0", 8000) == (
        "https://tinker.example.com"
    )
    assert public_base_url(None, "127.0.0.1", 8123) == "http://127.0.0.1:8123"
    assert public_base_url(None, "0.0.0.0", 8123) == "http://127.0.0.1:8123"
    assert public_base_url(None, "::1", 8123) == "http://[::1]:8123"
    for bad in ("ftp://x", "tinker.example.com", "https://x/?a=1", "https://u:p@x", ""):
        with pytest.raises(ValueError, match="--public-url"):
            check_public_url(bad)

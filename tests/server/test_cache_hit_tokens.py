"""Cost fields: `SampleResponse.prompt_cache_hit_tokens` comes from the sampler's prefix cache
on every sample, OpenAI's `usage.prompt_tokens_details.cached_tokens` says the same, and
metering counts the cached and the computed prompt tokens apart."""

from __future__ import annotations

import openai
from tinker import types

from lorafleet.sample.prefix_cache import DEFAULT_BLOCK_TOKENS
from lorafleet.server.state.keys import hash_key, tenant_id
from tests.server.conftest import KEY_A, connect

# three full cache blocks and a tail: the last prompt position is never cached
PROMPT = [(7 * i + 3) % 400 + 2 for i in range(3 * DEFAULT_BLOCK_TOKENS + 5)]
GREEDY = types.SamplingParams(max_tokens=3, temperature=0.0, stop=[])


def usage_counters(server, run: str = "") -> dict[str, float]:
    tenant = tenant_id(hash_key(KEY_A))
    totals: dict[str, float] = {}
    for who, r, counter, value in server.service.metering.totals(None):
        if who == tenant and r == run:
            totals[counter] = totals.get(counter, 0.0) + value
    return totals


def test_prompt_cache_hit_tokens_on_sample_and_openai(server, base_model):
    sc = connect(server, KEY_A)
    try:
        sampler = sc.create_sampling_client(base_model=base_model).result()
        before = usage_counters(server)
        first = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, GREEDY).result()
        again = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, GREEDY).result()
        # the second request reads every full block of the prompt but its last position
        hit = (len(PROMPT) - 1) // DEFAULT_BLOCK_TOKENS * DEFAULT_BLOCK_TOKENS
        assert first.prompt_cache_hit_tokens in (0, hit)  # another test may have cached it
        assert again.prompt_cache_hit_tokens == hit
        after = usage_counters(server)
        cached = after.get("cached_prefill_tokens", 0) - before.get("cached_prefill_tokens", 0)
        computed = after.get("prefill_tokens", 0) - before.get("prefill_tokens", 0)
        assert cached == first.prompt_cache_hit_tokens + hit
        assert cached + computed == 2 * len(PROMPT)

        oai = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY_A, max_retries=0)
        out = oai.completions.create(
            model=server.service.served.names[0], prompt=PROMPT, max_tokens=2, temperature=0.0
        )
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        assert out.usage.prompt_tokens_details.cached_tokens == hit
    finally:
        sc.close("success").result(timeout=30)

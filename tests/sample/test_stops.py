"""Stop strings that span several tokens cut at the token completing them (BPE tokenizer)."""

from __future__ import annotations

import pytest

from lorafleet.engines import colocate
from lorafleet.model.loader import load_base
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.sample import SampleRequest, SamplingParams
from lorafleet.sample.stops import StopChecker
from lorafleet.sample.validate import StopSpec

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def preset():
    base = load_base("tiny-qwen3")
    stack = colocate(
        base.model,
        resolve_tinker_targets(base.model),
        base_model_id="tiny-qwen3",
        tokenizer=base.tokenizer,
        r_max=8,
    )
    return stack, base.tokenizer


def first_completion(tokens: list[int], stops: list[str], tokenizer) -> int | None:
    """Reference: index of the first token after which the full decoded text contains a stop."""
    for k in range(len(tokens)):
        text = tokenizer.decode(tokens[: k + 1], skip_special_tokens=False)
        if any(s in text for s in stops):
            return k
    return None


def test_checker_cuts_at_the_token_that_completes_a_multi_token_string(preset):
    _, tokenizer = preset
    tokens = tokenizer.encode("so 12 + 3 = 15 and 4 * 5 = 20 then", add_special_tokens=False)
    checker = StopChecker(StopSpec(token_ids=frozenset(), strings=("= 20", "* 5 =")), tokenizer)
    stopped_at = next(k for k in range(len(tokens)) if checker.update(tokens[: k + 1]))
    assert stopped_at == first_completion(tokens, ["= 20", "* 5 ="], tokenizer)
    assert tokenizer.decode(tokens[: stopped_at + 1]).endswith("* 5 =")  # the earlier one wins
    spanned = [
        k for k in range(stopped_at + 1) if "*" in tokenizer.decode(tokens[k : stopped_at + 1])
    ]
    assert stopped_at - spanned[-1] >= 2, "the stop string must span several tokens"


def test_stop_strings_in_generation_cut_like_the_reference(preset):
    stack, tokenizer = preset
    text = [tokenizer.encode("the cat sat on", add_special_tokens=False)]
    free_params = SamplingParams(max_tokens=40, temperature=1.0, seed=17, stop=[])
    (free,) = stack.sampler.generate([SampleRequest(text[0], free_params)])
    tokens = free.sequences[0].tokens
    assert len(tokens) == 40
    full = tokenizer.decode(tokens, skip_special_tokens=False)
    checked = 0
    for start in range(3, len(full) - 6, 3):
        stop = full[start : start + 4]
        if "\ufffd" in stop or not stop.strip():
            continue
        cut = first_completion(tokens, [stop], tokenizer)
        assert cut is not None
        if stop in tokenizer.decode([tokens[cut]], skip_special_tokens=False):
            continue  # inside one token: not the case under test
        params = SamplingParams(max_tokens=40, temperature=1.0, seed=17, stop=[stop])
        (result,) = stack.sampler.generate([SampleRequest(text[0], params)])
        seq = result.sequences[0]
        assert seq.tokens == tokens[: cut + 1], f"stop {stop!r}"
        assert seq.stop_reason == "stop"
        assert seq.logprobs == pytest.approx(free.sequences[0].logprobs[: cut + 1], abs=1e-5)
        checked += 1
        if checked == 4:
            break
    assert checked >= 2


def test_a_single_string_stop_and_one_never_seen(preset):
    stack, tokenizer = preset
    prompt = tokenizer.encode("3 + 4 =", add_special_tokens=False)
    (free,) = stack.sampler.generate(
        [SampleRequest(prompt, SamplingParams(max_tokens=12, temperature=0.0, stop=[]))]
    )
    tokens = free.sequences[0].tokens
    piece = tokenizer.decode(tokens, skip_special_tokens=False)[2:5]
    cut = first_completion(tokens, [piece], tokenizer)
    as_str, never = stack.sampler.generate(
        [
            SampleRequest(prompt, SamplingParams(max_tokens=12, temperature=0.0, stop=piece)),
            SampleRequest(
                prompt, SamplingParams(max_tokens=12, temperature=0.0, stop=["\x00never\x00"])
            ),
        ]
    )
    assert as_str.sequences[0].tokens == tokens[: cut + 1]
    assert never.sequences[0].tokens == tokens and never.sequences[0].stop_reason == "length"

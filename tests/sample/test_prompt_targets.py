"""SampleEngine: `target_prompt_logprobs` equal the trainer's log-probs under each request's
version, also when a target-only request (which skips the rows before its first id) shares a
prefill with others; `prompt_alt_tokens_k` draws from their own RNG stream; bad fields fail alone."""

from __future__ import annotations

import re

import pytest
import torch

from lorafleet.sample import SampleRequest, SamplingParams
from lorafleet.sample.validate import MAX_PROMPT_SCORES
from lorafleet.train.engine import TrainItem
from tests.sample.test_engine import VOCAB, make_stack, prompt

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PARAMS = SamplingParams(max_tokens=3, temperature=1.0, seed=4, stop=[])


@pytest.fixture(scope="module")
def stack2():
    return make_stack(2)


def _trainer(stack, slot: int, text: list[int], ids: torch.Tensor) -> torch.Tensor:
    """Reference: the trainer's log-prob of ids[:, j] after each prompt prefix."""
    items = [
        TrainItem(
            slot,
            torch.tensor(text[:-1]),
            "cross_entropy",
            {"target_tokens": column.clamp(min=0), "weights": torch.zeros(len(text) - 1)},
        )
        for column in ids.T
    ]
    return torch.stack([out.logprobs for out in stack.trainer.forward(items).items], dim=1)


def _ids(seed: int, rows: int, width: int, first: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, width), generator=gen)
    ids[torch.rand(rows, width, generator=gen) < 0.4] = -1
    ids[:first] = -1
    ids[first, 0] = 1
    return ids


def test_targets_equal_the_trainers_in_a_shared_prefill(stack2):
    stack, keys = stack2
    texts = [prompt(20, 9), prompt(21, 6), prompt(22, 12)]
    targets = [_ids(1, 8, 4, first=5), None, _ids(2, 11, 2, first=0)]
    requests = [
        SampleRequest(texts[0], PARAMS, adapter=keys[0], target_prompt_logprobs=targets[0]),
        SampleRequest(texts[1], PARAMS, adapter=keys[1], prompt_logprobs=True),
        SampleRequest(texts[2], PARAMS, adapter=None, target_prompt_logprobs=targets[2]),
    ]
    mixed = stack.sampler.generate(requests)
    for i, (request, result) in enumerate(zip(requests, mixed, strict=True)):
        (alone,) = stack.sampler.generate([request])
        assert result.ok and alone.ok
        assert result.sequences[0].tokens == alone.sequences[0].tokens  # targets change nothing
        if targets[i] is None:
            assert result.target_prompt_logprobs is None
            continue
        ids = targets[i]
        slot = 0 if request.adapter is None else 1 + keys.index(request.adapter)
        reference = _trainer(stack, slot, texts[i], ids)
        named = ids >= 0
        got = result.target_prompt_logprobs
        assert got.dtype == torch.float32 and got.shape == ids.shape
        torch.testing.assert_close(got[named], reference[named], atol=1e-4, rtol=0)
        assert torch.all(got[~named] == 0.0)
        torch.testing.assert_close(alone.target_prompt_logprobs, got, atol=1e-5, rtol=0)
    plain = stack.sampler.generate([SampleRequest(texts[0], PARAMS, adapter=keys[0])])[0]
    assert plain.sequences[0].tokens == mixed[0].sequences[0].tokens


def test_alt_tokens_have_their_own_rng_and_raw_logprobs(stack2):
    stack, keys = stack2
    text = prompt(30, 7)
    with_alt = SampleRequest(
        text, PARAMS, adapter=keys[0], prompt_alt_tokens_k=5, prompt_logprobs=True
    )
    (a,) = stack.sampler.generate([with_alt])
    (b,) = stack.sampler.generate([with_alt])
    (plain,) = stack.sampler.generate([SampleRequest(text, PARAMS, adapter=keys[0])])
    assert a.sequences[0].tokens == plain.sequences[0].tokens  # the sequences' draws unchanged
    assert torch.equal(a.prompt_alt_tokens.tokens, b.prompt_alt_tokens.tokens)  # seeded
    tokens = a.prompt_alt_tokens.tokens
    assert tokens.shape == (len(text) - 1, 5) and tokens.dtype == torch.int64
    (scored,) = stack.sampler.generate(
        [SampleRequest(text, PARAMS, adapter=keys[0], target_prompt_logprobs=tokens)]
    )
    torch.testing.assert_close(
        a.prompt_alt_tokens.logprobs, scored.target_prompt_logprobs, atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        a.prompt_alt_tokens.logprobs, _trainer(stack, 1, text, tokens), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("target_prompt_logprobs", torch.zeros((3, 2), dtype=torch.int64), r"= \[5, K\]"),
        ("target_prompt_logprobs", torch.zeros((5, 2)), r"int64 token ids"),
        ("target_prompt_logprobs", torch.full((5, 2), -1), r"names no token id"),
        ("target_prompt_logprobs", torch.full((5, 2), VOCAB), r"\[0, 0\] = 96 is neither"),
        (
            "target_prompt_logprobs",
            torch.zeros((5, 1), dtype=torch.int64).expand(5, MAX_PROMPT_SCORES // 5 + 1),
            r"more than this sampler's limit",
        ),
        ("prompt_alt_tokens_k", -1, r"prompt_alt_tokens_k must be >= 0"),
        ("prompt_alt_tokens_k", MAX_PROMPT_SCORES // 5 + 1, r"more than this sampler's limit"),
    ],
)
def test_bad_fields_fail_alone(stack2, field, value, match):
    stack, keys = stack2
    bad = SampleRequest(prompt(40, 6), PARAMS, adapter=keys[0], **{field: value})
    good = SampleRequest(prompt(41, 6), PARAMS, adapter=keys[1])
    failed, ok = stack.sampler.generate([bad, good])
    assert failed.error is not None and failed.error.code == "invalid_request"
    assert field in failed.error.message
    assert re.search(match, failed.error.message)
    assert ok.ok and len(ok.sequences[0].tokens) == 3

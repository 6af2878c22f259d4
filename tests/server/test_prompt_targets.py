"""`target_prompt_logprobs` and `prompt_alt_tokens_k` through the real SDK: target ids are scored
as the trainer scores them (base and adapter version), in the request's dense or sparse layout;
alternative tokens are draws at the request's temperature with their raw log-probs; bad tensors
fail with errors that name the field."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from lorafleet.sample.validate import MAX_PROMPT_SCORES
from lorafleet.server.errors import UserError
from lorafleet.server.http.prompt_targets import parse_targets
from tests.server.conftest import VOCAB, sl_datum

PROMPT = [11, 40, 7, 300, 21, 5, 90, 17, 250, 3, 64, 8]
ROWS = len(PROMPT) - 1
FIRST_ROW = 3  # rows 0..2 name no id: they are not computed and come back 0.0


WIDTH = 6


def _targets(seed: int, width: int = WIDTH) -> torch.Tensor:
    """Random ids with some unused cells, and the prompt's own next token in column 0."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (ROWS, width), generator=gen)
    ids[:, 0] = torch.tensor(PROMPT[1:])
    ids[torch.rand(ROWS, width, generator=gen) < 0.6] = -1  # sparse enough for the SDK's CSR
    ids[:FIRST_ROW] = -1
    ids[FIRST_ROW, 1] = 5  # at least one id in the first scored row
    return ids


def _trainer_logprobs(tc: tinker.TrainingClient, ids: torch.Tensor) -> torch.Tensor:
    """Reference: the trainer's forward, one cross_entropy datum per column of ids."""
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(PROMPT[:-1]),
            loss_fn_inputs={
                "target_tokens": column.clamp(min=0).tolist(),
                "weights": [0.0] * ROWS,
            },
        )
        for column in ids.T
    ]
    out = tc.forward(data, "cross_entropy").result()
    return torch.stack([o["logprobs"].to_torch() for o in out.loss_fn_outputs], dim=1)


def _score(sampler: tinker.SamplingClient, target: types.TensorData, **kw) -> types.SampleResponse:
    return sampler.sample(
        types.ModelInput.from_ints(PROMPT),
        1,
        types.SamplingParams(max_tokens=1, temperature=0.0),
        target_prompt_logprobs=target,
        **kw,
    ).result()


def _check_against(
    sampler: tinker.SamplingClient, tc: tinker.TrainingClient, ids: torch.Tensor
) -> torch.Tensor:
    reference = _trainer_logprobs(tc, ids)
    named = ids >= 0
    dense = _score(sampler, types.TensorData.from_torch(ids), include_prompt_logprobs=True)
    values = dense.target_prompt_logprobs.to_torch()
    assert dense.target_prompt_logprobs.dtype == "float32" and list(values.shape) == [ROWS, WIDTH]
    torch.testing.assert_close(values[named], reference[named], atol=1e-4, rtol=0)
    assert torch.all(values[~named] == 0.0)  # unused cells and rows before the first id
    # column 0 holds the prompt's own tokens: the same numbers as prompt_logprobs
    own = named[:, 0]
    prompt_lp = torch.tensor(dense.prompt_logprobs[1:], dtype=torch.float32)
    torch.testing.assert_close(values[own, 0], prompt_lp[own], atol=1e-5, rtol=0)

    sparse_in = types.TensorData.from_torch_sparse(ids, pad_value=-1)
    assert sparse_in.sparse_crow_indices is not None  # the SDK did send CSR
    sparse = _score(sampler, sparse_in).target_prompt_logprobs
    assert sparse.sparse_crow_indices == sparse_in.sparse_crow_indices  # the request's layout
    assert sparse.sparse_col_indices == sparse_in.sparse_col_indices
    np.testing.assert_array_equal(sparse.to_torch().numpy(), values.numpy())
    return values


def test_target_logprobs_equal_the_trainers_for_base_and_adapter(client_a, base_model):
    tc = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=61).result()
    ids = _targets(1)
    base = client_a.create_sampling_client(base_model=base_model).result()
    before = _check_against(base, tc, ids)  # a fresh adapter (B = 0) is the base model

    for _ in range(3):
        tc.forward_backward([sl_datum(PROMPT)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    adapted = tc.save_weights_and_get_sampling_client().result()
    after = _check_against(adapted, tc, ids)
    named = ids >= 0
    assert not torch.allclose(before[named], after[named], atol=1e-3)  # the adapter was used
    # the base sampler still scores with the base
    base_again = _score(base, types.TensorData.from_torch(ids)).target_prompt_logprobs.to_torch()
    torch.testing.assert_close(base_again, before, atol=1e-5, rtol=0)


def test_the_cookbook_decisions_call(client_a, base_model):
    """recipes/decisions.sample_decision: sparse ids in the last row only, read back dense."""
    sampler = client_a.create_sampling_client(base_model=base_model).result()
    labels = [65, 66, 67, 68]
    target_ids = torch.full((ROWS, len(labels)), -1, dtype=torch.int64)
    target_ids[ROWS - 1] = torch.tensor(labels)
    response = sampler.sample(
        prompt=types.ModelInput.from_ints(PROMPT),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=1),
        target_prompt_logprobs=types.TensorData.from_torch_sparse(target_ids, pad_value=-1),
    ).result()
    logprobs = response.target_prompt_logprobs.to_torch()[ROWS - 1]
    tc = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=62).result()
    reference = _trainer_logprobs(tc, target_ids)[ROWS - 1]  # a fresh adapter: the base
    torch.testing.assert_close(logprobs, reference, atol=1e-4, rtol=0)
    assert torch.softmax(logprobs, dim=0).sum().item() == pytest.approx(1.0)


def test_alt_tokens_greedy_are_the_top_tokens(client_a, base_model):
    sampler = client_a.create_sampling_client(base_model=base_model).result()
    result = sampler.sample(
        types.ModelInput.from_ints(PROMPT),
        2,  # one prompt, scored once for both samples
        types.SamplingParams(max_tokens=1, temperature=0.0),
        topk_prompt_logprobs=1,
        prompt_alt_tokens_k=3,
    ).result()
    assert len(result.sequences) == 2
    alt = result.prompt_alt_tokens
    assert alt.tokens.dtype == "int64" and alt.logprobs.dtype == "float32"
    tokens, logprobs = alt.tokens.to_torch(), alt.logprobs.to_torch()
    assert list(tokens.shape) == [ROWS, 3] and list(logprobs.shape) == [ROWS, 3]
    for i in range(ROWS):
        ((best, best_lp),) = result.topk_prompt_logprobs[i + 1]  # row i: prompt position i + 1
        assert tokens[i].tolist() == [best] * 3
        assert logprobs[i].tolist() == pytest.approx([best_lp] * 3, abs=1e-5)


def _alt_draws(sampler, temperature: float, seed: int, k: int) -> types.PromptAltTokens:
    params = types.SamplingParams(max_tokens=1, temperature=temperature, seed=seed)
    prompt = types.ModelInput.from_ints(PROMPT)
    return sampler.sample(prompt, 1, params, prompt_alt_tokens_k=k).result().prompt_alt_tokens


def test_alt_tokens_are_draws_at_the_request_temperature(client_a, base_model):
    sampler = client_a.create_sampling_client(base_model=base_model).result()
    every_id = torch.arange(VOCAB).expand(ROWS, VOCAB).contiguous()
    dist = _score(sampler, types.TensorData.from_torch(every_id)).target_prompt_logprobs.to_torch()
    k, seeds = 20, range(30)
    for temperature in (1.0, 0.5):
        draws = [_alt_draws(sampler, temperature, seed, k) for seed in seeds]
        tokens = torch.cat([d.tokens.to_torch() for d in draws], dim=1)  # [ROWS, k * seeds]
        logprobs = torch.cat([d.logprobs.to_torch() for d in draws], dim=1)
        # the raw (temperature 1) log-prob of each drawn token at its position
        torch.testing.assert_close(logprobs, dist.gather(1, tokens), atol=1e-5, rtol=0)
        # The summed raw log-prob of the draws against its law under the tempered distribution
        # (a draw's log-prob has mean sum(p_T * logp) and a known variance): 5 sigma here,
        # while temperatures 1 and 0.5 are 13 sigma apart on this model.
        p_t = torch.softmax(dist / temperature, dim=1)
        mean = (p_t * dist).sum(dim=1)
        var = (p_t * dist**2).sum(dim=1) - mean**2
        n = tokens.shape[1]
        total, expected = logprobs.sum().item(), (n * mean).sum().item()
        sigma = (n * var).sum().sqrt().item()
        assert abs(total - expected) < 5 * sigma, (temperature, total, expected, sigma)
        again = _alt_draws(sampler, temperature, 0, k)
        assert torch.equal(again.tokens.to_torch(), draws[0].tokens.to_torch())  # seeded
        assert not torch.equal(draws[1].tokens.to_torch(), draws[0].tokens.to_torch())


def test_bad_requests_fail_naming_the_field(client_a, base_model):
    sampler = client_a.create_sampling_client(base_model=base_model).result()
    prompt = types.ModelInput.from_ints(PROMPT)
    params = types.SamplingParams(max_tokens=1)

    def fails(match: str, **kw) -> None:
        with pytest.raises(tinker.RequestFailedError, match=match):
            sampler.sample(prompt, 1, params, **kw).result()

    ids = torch.full((ROWS, 2), -1, dtype=torch.int64)
    fails(
        r"target_prompt_logprobs names no token id",
        target_prompt_logprobs=types.TensorData.from_torch(ids),
    )
    wrong_rows = torch.zeros((ROWS - 1, 2), dtype=torch.int64)
    fails(
        rf"target_prompt_logprobs.shape must be \[len\(prompt\) - 1, K\] = \[{ROWS}, K\]",
        target_prompt_logprobs=types.TensorData.from_torch(wrong_rows),
    )
    ids[4, 1] = VOCAB + 3
    fails(
        rf"target_prompt_logprobs\[4, 1\] = {VOCAB + 3} is neither -1 \(unused\) nor a token id",
        target_prompt_logprobs=types.TensorData.from_torch(ids),
    )
    ids[4, 1] = -2
    fails(
        r"target_prompt_logprobs.data\[9\] = -2",
        target_prompt_logprobs=types.TensorData.from_torch(ids),
    )
    wide = MAX_PROMPT_SCORES // ROWS + 1
    fails(
        rf"prompt_alt_tokens_k={wide} with a {len(PROMPT)}-token prompt asks for",
        prompt_alt_tokens_k=wide,
    )
    # the SDK's own checks, before anything is sent
    with pytest.raises(ValueError, match="target_prompt_logprobs must be an int64 tensor"):
        sampler.sample(
            prompt, 1, params, target_prompt_logprobs=types.TensorData.from_torch(ids.float())
        )
    with pytest.raises(ValueError, match="prompt_alt_tokens_k must be 0 or greater"):
        sampler.sample(prompt, 1, params, prompt_alt_tokens_k=-1)
    # and the sampler still serves
    assert len(sampler.sample(prompt, 1, params).result().sequences) == 1


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"data": [1], "dtype": "float32", "shape": [2, 1]}, r"dtype must be 'int64'"),
        ({"data": [1, 2], "dtype": "int64", "shape": [2]}, r"shape must be"),
        ({"data": [1, 2.5], "dtype": "int64", "shape": [2, 1]}, r"data\[1\] = 2.5 is not"),
        ({"data": [1, True], "dtype": "int64", "shape": [2, 1]}, r"data\[1\] = True is not"),
        ({"data": [1], "dtype": "int64", "shape": [2, 1]}, r"data has 1 values but shape"),
        (
            {"data": [1, 2], "dtype": "int64", "shape": [2, 1], "x": 1},
            r"unknown field\(s\) \['x'\]",
        ),
        (
            {"data": [1], "dtype": "int64", "shape": [2, 3], "sparse_crow_indices": [0, 1, 1]},
            r"come together",
        ),
        (
            {
                "data": [1],
                "dtype": "int64",
                "shape": [2, 3],
                "sparse_crow_indices": [0, 2, 1],
                "sparse_col_indices": [0],
            },
            r"sparse_crow_indices must start at 0, never decrease",
        ),
        (
            {
                "data": [1],
                "dtype": "int64",
                "shape": [2, 3],
                "sparse_crow_indices": [0, 1, 1],
                "sparse_col_indices": [3],
            },
            r"sparse_col_indices has 3, outside \[0, 3\)",
        ),
        (
            {
                "data": [1, 2],
                "dtype": "int64",
                "shape": [2, 3],
                "sparse_crow_indices": [0, 2, 2],
                "sparse_col_indices": [1, 1],
            },
            r"increasing within each row",
        ),
        (
            {"data": [1], "dtype": "int64", "shape": [2, MAX_PROMPT_SCORES // 2 + 1]},
            r"more than this server's limit",
        ),
    ],
)
def test_malformed_tensors_are_refused_before_anything_runs(raw, match):
    with pytest.raises(UserError, match=match):
        parse_targets(raw, prompt_len=3)


def test_sparse_targets_densify_with_unused_cells():
    parsed = parse_targets(
        {
            "data": [7, -1, 9],
            "dtype": "int64",
            "shape": [3, 2],
            "sparse_crow_indices": [0, 0, 2, 3],
            "sparse_col_indices": [0, 1, 1],
        },
        prompt_len=4,
    )
    assert parsed.ids.tolist() == [[-1, -1], [7, -1], [-1, 9]]
    assert parsed.crow.tolist() == [0, 0, 2, 3] and parsed.col.tolist() == [0, 1, 1]

"""Sampler: greedy, logit bias, top-k/top-p supports, seeds, parameter validation."""

from __future__ import annotations

import pytest
import torch

from services.engine.step.sampling import InvalidRequestError, SamplingParams, sample_one


def _logits() -> torch.Tensor:
    return torch.tensor([1.0, 3.0, 2.0, 0.5, -1.0])


def test_greedy_is_argmax() -> None:
    assert sample_one(_logits(), SamplingParams(temperature=0.0), None) == 1


def test_logit_bias_changes_greedy_choice() -> None:
    p = SamplingParams(temperature=0.0, logit_bias={4: 100.0})
    assert sample_one(_logits(), p, None) == 4
    p = SamplingParams(temperature=0.0, logit_bias={1: -100.0})
    assert sample_one(_logits(), p, None) == 2


def test_top_k_restricts_support() -> None:
    p = SamplingParams(temperature=1.5, top_k=2, seed=0)
    gen = p.make_generator(torch.device("cpu"))
    seen = {sample_one(_logits(), p, gen) for _ in range(300)}
    assert seen == {1, 2}


def test_top_p_restricts_support() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = SamplingParams(temperature=1.0, top_p=0.7, seed=1)
    gen = p.make_generator(torch.device("cpu"))
    seen = {sample_one(logits, p, gen) for _ in range(300)}
    assert seen == {0, 1}


def test_same_seed_same_tokens_other_seed_differs() -> None:
    logits = torch.zeros(1000)

    def draw(seed: int) -> list[int]:
        p = SamplingParams(temperature=1.0, seed=seed)
        gen = p.make_generator(torch.device("cpu"))
        return [sample_one(logits, p, gen) for _ in range(20)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (SamplingParams(temperature=-0.1), "temperature"),
        (SamplingParams(temperature=2.5), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_k=-1), "top_k"),
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(logit_bias={99: 1.0}), "token id 99"),
        (SamplingParams(logit_bias={1: 101.0}), r"logit_bias\[1\]"),
        (SamplingParams(stop=("",)), "stop"),
    ],
)
def test_validation_names_the_parameter(params: SamplingParams, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        params.validate(vocab_size=10)

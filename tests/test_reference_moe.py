"""The reference expert layer against a token-by-token statement of the same maths."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.runtime.moe import ExpertWeights, RoutingRule, SharedExpert, reference_moe, route


def _expert(g: torch.Generator, h: int, i: int) -> ExpertWeights:
    return ExpertWeights(torch.randn(i, h, generator=g), torch.randn(i, h, generator=g), torch.randn(h, i, generator=g))


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(0, 9), experts=st.integers(1, 6), data=st.data(), normalize=st.booleans(),
       shared=st.booleans(), seed=st.integers(0, 1000))
def test_reference_equals_per_token_loop(tokens, experts, data, normalize, shared, seed) -> None:
    top_k = data.draw(st.integers(1, experts))
    g = torch.Generator().manual_seed(seed)
    h, i = 8, 12
    bank = [_expert(g, h, i) for _ in range(experts)]
    shared_expert = SharedExpert(_expert(g, h, 10), torch.randn(1, h, generator=g)) if shared else None
    x = torch.randn(tokens, h, generator=g, dtype=torch.float64).float()
    logits = torch.randn(tokens, experts, generator=g)
    rule = RoutingRule(top_k, normalize)
    got = reference_moe(x, logits, rule, bank, shared_expert)
    assert got.shape == (tokens, h)
    for t in range(tokens):
        probs = torch.softmax(logits[t], -1)
        top = sorted(range(experts), key=lambda e: -probs[e])[:top_k]
        scale = sum(probs[e] for e in top) if normalize else 1.0
        want = sum(probs[e] / scale * bank[e](x[t : t + 1])[0] for e in top)
        if shared_expert is not None:
            want = want + torch.sigmoid(shared_expert.gate @ x[t]) * shared_expert.mlp(x[t : t + 1])[0]
        assert torch.allclose(got[t], want, atol=1e-3, rtol=1e-4)


def test_route_normalises_only_when_asked() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w, ids = route(logits, RoutingRule(2, normalize=True))
    assert ids.tolist() == [[0, 1]] and torch.allclose(w.sum(), torch.tensor(1.0))
    w2, _ = route(logits, RoutingRule(2, normalize=False))
    assert w2.sum() < 1


def test_expert_converts_stored_dtype_per_call() -> None:
    g = torch.Generator().manual_seed(0)
    e32 = _expert(g, 8, 4)
    e16 = ExpertWeights(e32.gate.bfloat16(), e32.up.bfloat16(), e32.down.bfloat16())
    x = torch.randn(3, 8, generator=g)
    assert e16(x).dtype == torch.float32 and e16.gate.dtype == torch.bfloat16
    assert torch.allclose(e16(x), e32(x), rtol=0.05, atol=0.1)


@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(1, 9), experts=st.integers(2, 16), eps=st.sampled_from([0.0, 0.01, 0.2, 1.0]),
       spread=st.sampled_from([0.01, 1.0, 5.0]), shift=st.sampled_from([-3.0, 0.0, 3.0]), seed=st.integers(0, 1000))
def test_sparsemixer_matches_transformers_eval(tokens, experts, eps, spread, shift, seed) -> None:
    """PhiMoE's routing is transformers' `sparsemixer` in eval mode: the same two experts and the same weights,
    for logits close together or far apart, around zero or all of one sign (the threshold divides by |logit|)."""
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g) * spread + shift
    want_w, want_ids = sparsemixer(logits, jitter_eps=eps, training=False)
    got_w, got_ids = route(logits, RoutingRule(2, False, scoring="sparsemixer", jitter_eps=eps))
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(got_w, want_w)


def test_sparsemixer_threshold_changes_the_weights() -> None:
    """The threshold masks experts out of each softmax: a wider one spreads the weight, so it is not ignorable."""
    logits = torch.tensor([[2.0, 1.9, 1.0, -1.0]])
    narrow, _ = route(logits, RoutingRule(2, False, scoring="sparsemixer", jitter_eps=0.01))
    wide, _ = route(logits, RoutingRule(2, False, scoring="sparsemixer", jitter_eps=0.5))
    assert narrow[0, 0] == 1.0  # only the best expert lies within 2 % of itself
    assert wide[0, 0] < 1.0


def test_sigmoid_without_a_correction_chooses_by_the_logits_even_where_the_scores_round_to_one() -> None:
    """Llama 4's router takes the top logit: logits above about 17 all have a float32 sigmoid of 1.0, and choosing by
    those scores would tie them (the lower id winning); the logits keep their order. With a correction bias the
    scores plus the bias choose, as DeepSeek-V3 does."""
    logits = torch.tensor([[20.0, 30.0, -1.0, 25.0]])
    assert torch.sigmoid(logits)[0, 0] == torch.sigmoid(logits)[0, 1] == 1.0
    weights, ids = route(logits, RoutingRule(2, normalize=False, scoring="sigmoid"))
    assert ids.tolist() == [[1, 3]] and weights.tolist() == [[1.0, 1.0]]
    _, ids = route(logits, RoutingRule(1, normalize=False, scoring="sigmoid"), torch.tensor([0.0, 0.0, 5.0, 0.0]))
    assert ids.tolist() == [[2]]

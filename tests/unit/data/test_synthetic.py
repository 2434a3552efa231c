"""The synthetic Markov source: determinism, exact entropy rate, empirical convergence to it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from megatron_mecefo.data.synthetic import (
    MarkovSource,
    MarkovSourceSpec,
    empirical_conditional_entropy,
)


def test_same_seed_same_corpus_other_seed_other_corpus():
    a = MarkovSource(MarkovSourceSpec(seed=5)).generate(50, seed=5)
    b = MarkovSource(MarkovSourceSpec(seed=5)).generate(50, seed=5)
    c = MarkovSource(MarkovSourceSpec(seed=6)).generate(50, seed=6)
    assert [d.text for d in a] == [d.text for d in b]
    assert [d.conditional_entropy_nats for d in a] == [d.conditional_entropy_nats for d in b]
    assert [d.text for d in a] != [d.text for d in c]


def test_entropy_rate_matches_hand_computed_chain():
    # 2 words, uniform successors, end w.p. 1/2: H(word) = 1.5 ln2, H(boundary) = ln2,
    # stationary boundary mass 1/3  ->  rate = 2/3 * 1.5 ln2 + 1/3 * ln2 = 4/3 ln2.
    spec = MarkovSourceSpec(
        seed=0, num_words=2, branching=2, zipf_exponent=0.0, mean_document_words=2
    )
    assert MarkovSource(spec).entropy_rate() == pytest.approx(4 / 3 * math.log(2), rel=1e-12)


def test_stationary_distribution_is_stationary():
    source = MarkovSource(MarkovSourceSpec(seed=3, num_words=200))
    pi = source.stationary_distribution()
    assert np.allclose(pi @ source.transition_matrix(), pi, atol=1e-12)
    assert pi.sum() == pytest.approx(1.0)


def test_empirical_entropy_approaches_the_computed_rate():
    source = MarkovSource(MarkovSourceSpec(seed=11))
    rate = source.entropy_rate()
    docs = source.generate(3000, seed=11)
    symbols = sum(d.num_words + 1 for d in docs)
    # Realized loss of the true model: converges at 1/sqrt(N) (N ~ 360k symbols here).
    nll = sum(d.nll_nats for d in docs) / symbols
    assert nll == pytest.approx(rate, rel=0.01)
    # Plug-in conditional entropy from bigram counts: biased low by about cells / 2N.
    plug_in = empirical_conditional_entropy(source, docs)
    assert rate - 0.05 < plug_in < rate + 0.005
    # The per-document conditional entropies sum to the same quantity.
    cond = sum(d.conditional_entropy_nats for d in docs) / symbols
    assert cond == pytest.approx(rate, rel=0.01)
    # The source is far from uniform: there is structure to learn.
    assert rate < 0.5 * math.log(source.spec.num_words)

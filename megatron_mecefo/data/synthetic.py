"""The embedded demo corpus: a seeded word-level Markov source with a known entropy rate.

Owns the source (pseudo-words, sparse Zipfian successor tables, a document boundary state), document
generation, and the exact entropy rate. Pure numpy: no torch, no megatron, no files.

The chain has `num_words` word states plus one boundary state B. A document starts in B, draws its
first word from B's successor table, moves word to word, and ends when it draws B again (probability
`1/mean_document_words` from every word). B is emitted as the end-of-document (EOD) token, so every
symbol the language model predicts (each word and each EOD) is one draw of this chain.
"""

from __future__ import annotations

import bisect
import dataclasses
import math

import numpy as np

_CONSONANTS = "bdfghklmnprstvz"
_VOWELS = "aeiou"


@dataclasses.dataclass(frozen=True)
class MarkovSourceSpec:
    """Parameters of the synthetic source; together with `seed` they fix the corpus exactly."""

    seed: int = 1234
    """Seeds the word list, the successor tables and the sampled documents."""
    num_words: int = 1000
    """Word states (pseudo-words made of consonant-vowel syllables)."""
    branching: int = 16
    """Successors per word (the sparse transition support)."""
    zipf_exponent: float = 1.1
    """Successor k of a word has probability proportional to 1/k**zipf_exponent."""
    mean_document_words: int = 120
    """Mean document length in words (geometric: every word ends the document w.p. 1/this)."""

    def __post_init__(self) -> None:
        if self.num_words < 2 or not 1 <= self.branching <= self.num_words:
            raise ValueError("need num_words >= 2 and 1 <= branching <= num_words")
        if self.zipf_exponent < 0 or self.mean_document_words < 2:
            raise ValueError("need zipf_exponent >= 0 and mean_document_words >= 2")


@dataclasses.dataclass
class Document:
    """One generated document."""

    text: str
    """Words joined by single spaces (no EOD marker)."""
    num_words: int
    conditional_entropy_nats: float
    """Sum over the document's symbols (words and the final EOD) of H(next | current state)."""
    nll_nats: float
    """-log p(document) under the source (the realized loss of a perfect model)."""


class MarkovSource:
    """First-order word Markov chain with sparse Zipfian transitions and a document boundary state.

    State ids: 0..num_words-1 are words, `self.boundary == num_words` is the document boundary.
    """

    def __init__(self, spec: MarkovSourceSpec) -> None:
        self.spec = spec
        rng = np.random.default_rng(spec.seed)
        self.words = _make_words(rng, spec.num_words)
        self.boundary = spec.num_words
        w, k = spec.num_words, spec.branching
        # Successors are drawn (distinct) by a global Zipfian popularity: short words are frequent.
        popularity = 1.0 / np.arange(1, w + 1) ** 1.0
        popularity /= popularity.sum()
        zipf = 1.0 / np.arange(1, k + 1) ** spec.zipf_exponent
        zipf /= zipf.sum()
        q_end = 1.0 / spec.mean_document_words
        self.successors: list[np.ndarray] = []
        self.probs: list[np.ndarray] = []
        for state in range(w + 1):
            succ = rng.choice(w, size=k, replace=False, p=popularity)
            if state == self.boundary:  # a document has at least one word
                self.successors.append(succ)
                self.probs.append(zipf.copy())
            else:
                self.successors.append(np.append(succ, self.boundary))
                self.probs.append(np.append((1.0 - q_end) * zipf, q_end))
        self.state_entropy = np.array([-(p * np.log(p)).sum() for p in self.probs])
        self._cum = [np.cumsum(p).tolist() for p in self.probs]
        self._succ_list = [s.tolist() for s in self.successors]
        self._logp = [np.log(p).tolist() for p in self.probs]

    @property
    def num_states(self) -> int:
        return self.spec.num_words + 1

    def transition_matrix(self) -> np.ndarray:
        """Dense [num_states, num_states] row-stochastic matrix."""
        mat = np.zeros((self.num_states, self.num_states))
        for state, (succ, p) in enumerate(zip(self.successors, self.probs)):
            mat[state, succ] += p
        return mat

    def stationary_distribution(self) -> np.ndarray:
        """Solve pi P = pi, sum(pi) = 1 exactly (dense solve; the chain has one closed class)."""
        mat = self.transition_matrix()
        n = self.num_states
        a = mat.T - np.eye(n)
        a[-1, :] = 1.0  # replace one (redundant) balance equation by the normalisation
        b = np.zeros(n)
        b[-1] = 1.0
        pi = np.linalg.solve(a, b)
        return np.clip(pi, 0.0, None) / np.clip(pi, 0.0, None).sum()

    def entropy_rate(self) -> float:
        """Entropy rate in nats per symbol (a symbol is a word or an EOD): sum_i pi_i H(P_i)."""
        return float(self.stationary_distribution() @ self.state_entropy)

    def generate(self, num_documents: int, seed: int | None = None) -> list[Document]:
        """Sample `num_documents` documents; deterministic for (spec, seed)."""
        rng = np.random.default_rng([self.spec.seed, 0 if seed is None else seed + 1])
        # One uniform per symbol; drawn in blocks so the loop stays in plain Python (fast).
        buf: list[float] = []
        pos = 0
        docs = []
        for _ in range(num_documents):
            state, words, h_sum, nll = self.boundary, [], 0.0, 0.0
            while True:
                if pos == len(buf):
                    buf, pos = rng.random(65536).tolist(), 0
                u = buf[pos]
                pos += 1
                cum = self._cum[state]
                j = min(bisect.bisect_right(cum, u * cum[-1]), len(cum) - 1)
                h_sum += self.state_entropy[state]
                nll -= self._logp[state][j]
                state = self._succ_list[state][j]
                if state == self.boundary:
                    break
                words.append(self.words[state])
            docs.append(Document(" ".join(words), len(words), float(h_sum), nll))
        return docs


def empirical_conditional_entropy(source: MarkovSource, docs: list[Document]) -> float:
    """Plug-in estimate of H(next | current) in nats/symbol from bigram counts of `docs`."""
    index = {word: i for i, word in enumerate(source.words)}
    b = source.boundary
    pairs: dict[tuple[int, int], int] = {}
    for doc in docs:
        states = [b, *(index[w] for w in doc.text.split(" ") if w), b]
        for prev, nxt in zip(states[:-1], states[1:]):
            pairs[(prev, nxt)] = pairs.get((prev, nxt), 0) + 1
    totals: dict[int, int] = {}
    for (prev, _), c in pairs.items():
        totals[prev] = totals.get(prev, 0) + c
    n = sum(totals.values())
    return -sum(c / n * math.log(c / totals[prev]) for (prev, _), c in pairs.items())


def _make_words(rng: np.random.Generator, num_words: int) -> list[str]:
    """Distinct pseudo-words of 1-4 syllables, shortest first (index 0 is the most popular)."""
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    seen: set[str] = set()
    words: list[str] = []
    while len(words) < num_words:
        n_syll = int(rng.choice([1, 2, 3, 4], p=[0.05, 0.45, 0.35, 0.15]))
        word = "".join(syllables[i] for i in rng.integers(0, len(syllables), size=n_syll))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return sorted(words, key=len)

"""Weighted blends of corpora: which corpus, and which of its samples, each position reads.

Legend: K corpora with weights w_k (normalised, sum 1), position i = 0, 1, 2, ... of the
blended sample stream, c_k(i) = samples taken from corpus k before position i.

Megatron's rule (its `build_blending_indices`): position i reads from the corpus furthest
below its target,

    k(i) = argmax_k  w_k * max(i, 1) - c_k(i)       (ties: the lowest k),

and reads that corpus's sample c_k(i); then c_k grows by one. Every deficit w_k * n - c_k
stays within (-1, K), so over any window of n positions corpus k's share is w_k to within
2K/n: the shares converge to the weights.

Exactly, on any machine: the weights are quantised to integers W_k (sum S, about
2^31 / (2K + 4), every W_k >= 1) and the deficits kept as integers
D_k(i) = W_k * max(i, 1) - S * c_k(i), which change by W_k * [i >= 1] - S * [k = k(i)] per
position and stay within (-S, K S]: int32 never overflows, and no rounding can make two
machines or two layouts pick differently. The shares converge to W_k / S, within 1e-7 of
w_k for K <= 10.

One dataset given for several entries (a corpus listed twice: "0.3 web 0.3 web 0.4 code") is
one corpus whose share is the sum of its entries': the entries are picked by the rule above, and
each pick reads that dataset's next sample, numbered over all its entries' picks,
j(i) = sum_{k' sharing k(i)'s dataset} c_k'(i). Numbered per entry, every sample would be read once
by each entry, side by side in the same global batch.

The stream is computed in chunks of CHUNK positions by a jitted `lax.scan` on the host CPU
(the rule is sequential: each pick depends on every earlier one); `BlendedDataset` extends
it on demand, so any position can be read and a resume at position P computes positions
[0, P) once (about 0.1 s per million positions), keeping only the last `WINDOW` of them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

CHUNK = 1 << 16            # positions per scan call (one compilation per number of corpora)
WINDOW = 64 * CHUNK        # positions a BlendedDataset keeps (10 bytes each: 42 MB)
MAX_CORPORA = 1 << 15      # corpus ids are int16


def quantise(weights) -> np.ndarray:
    """int64 [K] W_k >= 1, proportional to `weights` (positive, finite), summing to about
    2^31 / (2K + 4): the largest scale at which the integer deficits fit in int32."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or not 1 <= len(w) <= MAX_CORPORA or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"need 1 to {MAX_CORPORA} positive finite weights, got {weights!r}")
    scale = (1 << 31) // (2 * len(w) + 4)
    return np.maximum(1, np.rint(w / w.sum() * scale)).astype(np.int64)


@dataclass(frozen=True)
class BlendState:
    """Where the stream stands before position `position`: D_k and c_k (int64 [K] each)."""
    position: int
    deficit: np.ndarray
    count: np.ndarray

    @staticmethod
    def start(quanta: np.ndarray) -> "BlendState":
        """Before position 0: D_k(0) = W_k (max(0, 1) = 1), no samples taken."""
        return BlendState(0, quanta.copy(), np.zeros_like(quanta))


def blend_positions(quanta: np.ndarray, state: BlendState, n: int) -> tuple[np.ndarray, np.ndarray, BlendState]:
    """(corpus int16 [n], sample int64 [n], state after): positions [state.position, +n)."""
    corpus, sample = [], []
    while n > 0:
        take = min(n, CHUNK)
        k, j, state = _chunk(quanta, state)
        corpus.append(k[:take])
        sample.append(j[:take])
        if take < CHUNK:   # recompute the state at the cut: the chunk ran past it
            state = _state_at(quanta, state, k, take)
        n -= take
    if not corpus:
        return np.zeros(0, np.int16), np.zeros(0, np.int64), state
    return np.concatenate(corpus), np.concatenate(sample), state


def _state_at(quanta: np.ndarray, after: BlendState, k: np.ndarray, take: int) -> BlendState:
    """The state `take` positions into a chunk, from the state after the whole chunk `k`."""
    start = after.position - len(k)
    dropped = np.bincount(k[take:], minlength=len(quanta)).astype(np.int64)
    count = after.count - dropped
    n = max(start + take, 1)
    return BlendState(start + take, quanta * n - quanta.sum() * count, count)


def _chunk(quanta: np.ndarray, state: BlendState) -> tuple[np.ndarray, np.ndarray, BlendState]:
    """CHUNK positions from `state`: corpus ids, per-corpus sample numbers, the state after."""
    import jax

    # the scan counts this chunk's samples from 0 (int32); the totals before it, int64 here, are added
    # after: a corpus's count may pass 2^31 in a long run, its deficit never leaves (-S, K S]
    args = (np.asarray(state.deficit, np.int32), np.zeros(len(quanta), np.int32), np.asarray(quanta, np.int32),
            np.int32(quanta.sum()), np.int32(min(state.position, 1)))
    # on the host CPU whatever the default device: a GPU would run the CHUNK sequential steps far slower
    deficit, count, k, j = _scan(len(quanta))(*jax.device_put(args, jax.local_devices(backend="cpu")[0]))
    k = np.asarray(k)
    j = np.asarray(j).astype(np.int64) + state.count[k]
    after = BlendState(state.position + CHUNK, np.asarray(deficit, np.int64), state.count + np.asarray(count, np.int64))
    return k, j, after


@functools.cache
def _scan(num_corpora: int):
    """jit(lax.scan) of CHUNK picks: carry (D int32 [K], c int32 [K], grow), output (k, c_k).
    `grow` is 0 only before position 1 (max(i, 1) stays 1 from i = 0 to 1), then 1."""
    import jax
    import jax.numpy as jnp

    ids = jnp.arange(num_corpora, dtype=jnp.int32)

    def pick(carry, _, quanta, total):
        deficit, count, grow = carry
        k = jnp.argmax(deficit).astype(jnp.int32)            # the first maximum: ties go to the lowest k
        taken = (ids == k).astype(jnp.int32)
        out = (k.astype(jnp.int16), count[k])
        return (deficit - total * taken + quanta * grow, count + taken, jnp.int32(1)), out

    def run(deficit, count, quanta, total, grow):
        (deficit, count, _), (k, j) = jax.lax.scan(
            functools.partial(pick, quanta=quanta, total=total), (deficit, count, grow), None, length=CHUNK,
            unroll=8)
        return deficit, count, k, j
    return jax.jit(run)


class BlendedDataset:
    """Samples of K datasets blended by weight: `self[i]` is `datasets[k(i)][c_k(i)]` (j(i) where
    entries share a dataset).

    `datasets` are indexable by any non-negative integer (GPTDataset: epochs wrap); entries given
    the same dataset object share its samples (module docstring). The index
    arrays `corpus` (int16) and `sample` (int64) hold the positions [first, len(self)) computed
    so far, extended by whole chunks on demand: 10 bytes per position, up to twice `window` of
    them (older chunks are dropped as the stream moves on, so a run far into the stream holds a few
    tens of MB, not 10 bytes per sample ever read). Positions beyond are computed without being
    kept; a position before `first` is computed again from 0 (the loader reads forward).
    """

    def __init__(self, datasets, weights, window: int = WINDOW):
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        self.quanta = quantise(weights)
        # group[k]: the first entry holding k's dataset; entries of one group number its samples together
        first: dict[int, int] = {}
        self.group = np.array([first.setdefault(id(d), k) for k, d in enumerate(self.datasets)], np.int64)
        self.shared = len(first) < len(self.group)
        self.window = max(CHUNK, window // CHUNK * CHUNK)
        self._restart()

    def _restart(self) -> None:
        """Back to position 0, nothing kept."""
        self._state = BlendState.start(self.quanta)
        self.first = 0                            # the position of _corpus[0]
        self._corpus = np.zeros(0, np.int16)      # capacity doubles; the first len(self) - first are filled
        self._sample = np.zeros(0, np.int64)

    def __len__(self) -> int:
        """Positions computed so far (any position can be read: the stream is extended)."""
        return self._state.position

    @property
    def corpus(self) -> np.ndarray:
        """int16 [len(self) - first]: the corpus of positions first, first + 1, ..."""
        return self._corpus[:len(self) - self.first]

    @property
    def sample(self) -> np.ndarray:
        """int64 [len(self) - first]: the corpus's sample number at positions first, first + 1, ..."""
        return self._sample[:len(self) - self.first]

    @property
    def counts(self) -> np.ndarray:
        """int64 [K]: the samples each corpus gave to positions [0, len(self))."""
        return self._state.count.copy()

    @property
    def shares(self) -> list[float]:
        """The weights as the blend uses them: W_k / S."""
        return [float(q) / float(self.quanta.sum()) for q in self.quanta]

    def extend_to(self, n: int) -> None:
        """Make positions [n - window, n) readable (in whole chunks; the chunks wholly before them
        computed and not kept, storage doubles up to twice the window, so reading positions in
        order costs O(n) in all)."""
        if n <= len(self):
            return
        while len(self) + CHUNK <= n - self.window:     # wholly before the window: only the state moves on
            _, _, self._state = _chunk(self.quanta, self._state)
            self.first = len(self)
        have = len(self) - self.first
        if have >= 2 * self.window:                     # drop the oldest whole chunks
            drop = (have - self.window) // CHUNK * CHUNK
            self._corpus, self._sample = self._corpus[drop:have].copy(), self._sample[drop:have].copy()
            self.first, have = self.first + drop, have - drop
        more = -(-(n - len(self)) // CHUNK) * CHUNK
        if have + more > len(self._corpus):
            size = max(have + more, 2 * len(self._corpus))
            self._corpus = _grown(self._corpus, have, size)
            self._sample = _grown(self._sample, have, size)
        for at in range(have, have + more, CHUNK):    # chunk by chunk into place: no copy of the whole
            before = self._state.count
            k, j, self._state = _chunk(self.quanta, self._state)
            self._corpus[at:at + CHUNK] = k
            self._sample[at:at + CHUNK] = shared_samples(self.group, before, k) if self.shared else j

    def __getitem__(self, i: int) -> np.ndarray:
        """int32 [seq_len + 1]: the sample at blended position i (any i >= 0)."""
        if i < 0:
            raise IndexError(f"sample position must be >= 0, got {i}")
        if i < self.first:
            self._restart()
        self.extend_to(int(i) + 1)
        at = int(i) - self.first
        return self.datasets[int(self._corpus[at])][int(self._sample[at])]


def shared_samples(group: np.ndarray, before: np.ndarray, k: np.ndarray) -> np.ndarray:
    """int64 [n]: the sample each of n positions reads when entries share datasets (`group[k]`:
    the entry that stands for k's dataset): the group's count before these positions (entry
    counts `before`, summed over the group) plus the group's picks among the earlier positions."""
    g = group[k]
    base = np.zeros(len(group), np.int64)
    np.add.at(base, group, before)
    order = np.argsort(g, kind="stable")               # each group's positions, in stream order
    first = np.searchsorted(g[order], g[order], side="left")
    rank = np.empty(len(k), np.int64)
    rank[order] = np.arange(len(k)) - first
    return base[g] + rank


def _grown(a: np.ndarray, filled: int, size: int) -> np.ndarray:
    """A new array of `size` holding a[:filled] (the rest uninitialised: it is filled next)."""
    out = np.empty(size, a.dtype)
    out[:filled] = a[:filled]
    return out

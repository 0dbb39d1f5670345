"""The cohort's rows held once and read in float64 chunks (bounded memory at 60,000 users).

A replace-one estimator (``winsorized``, ``outlier_removal``, ``friendlycore``, ``few_users``)
receives one row per sampled unit. ``CohortRows`` keeps them as the owners produced them
(float32 in training runs), never converted or copied whole, padded *virtually* with zero rows
to the public n (missing units count as zero vectors, ``pad_to_population``), and hands out
float64 copies of row chunks on the fly. Every pass over the cohort (the centring mean, the
squared norms, the randomized rotation, the friend counts' distance blocks, the clipped and the
kept sums) works on one chunk at a time: the working memory is a few chunks, not n x d'
float64 values.

A chunk's float64 values are exactly the rows of the former whole-matrix float64 copy, so
every distance, norm and clipped value that decides a privacy-relevant branch is computed in
float64 as before, and the noise is drawn from the same generator in the same order; only
sums *over rows* (the centring mean, the clipped and the kept sums) are accumulated chunk by
chunk, a different floating-point summation order (tests/aggregators/test_chunked_rows.py
checks that a tiny chunk and one chunk covering everything release the same values).

The sizes here are the ones ``fedudp.aggregators.memory`` counts before a run starts.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

__all__ = [
    "DISTANCE_CHUNK",
    "F64",
    "OUTER_BYTES",
    "ROTATE_COPIES",
    "WORK_BYTES",
    "as_cohort",
    "chunk_rows",
    "chunks_bytes",
    "CohortRows",
    "outer_rows",
    "pad_to_population",
]

F64 = torch.float64
WORK_BYTES = 1 << 27  # one float64 working chunk: 128 MiB (rotation, sums, norms)
OUTER_BYTES = 1 << 30  # the friend counts' outer block of float64 rows: 1 GiB
DISTANCE_CHUNK = 1024  # rows of the friend counts' inner blocks (and of a distance block)
ROTATE_COPIES = 4  # float64 arrays of a chunk's size alive while it is rotated


def chunk_rows(width: int, budget: int | None = None) -> int:
    """Rows of ``width`` float64 values that fit in ``budget`` bytes (``WORK_BYTES``), at
    least one. (The budgets are read when called: a test may lower them.)

    Parameters
    ----------
    width : int
        Values per row.
    budget : int or None, default None
        Bytes (None: ``WORK_BYTES``).

    Returns
    -------
    int
        Rows per chunk (at least 1).
    """
    budget = WORK_BYTES if budget is None else budget
    return max(1, int(budget) // (8 * max(1, int(width))))


def outer_rows(width: int) -> int:
    """Rows of the friend counts' outer float64 block (``OUTER_BYTES``).

    Parameters
    ----------
    width : int
        Values per row.

    Returns
    -------
    int
        Rows per outer block (at least 1).
    """
    return chunk_rows(width, OUTER_BYTES)


def chunks_bytes() -> int:
    """Peak bytes of the float64 chunks alive in one pass (a chunk being rotated).

    Returns
    -------
    int
        Bytes.
    """
    return ROTATE_COPIES * WORK_BYTES


class CohortRows:
    """The rows ``G`` [k, d] (any float dtype, kept as given) of a cohort whose public size is
    ``n`` (>= k: rows k..n-1 are zero vectors, never stored). ``chunk``: rows per chunk of every
    pass (None: as many as fit in ``WORK_BYTES`` of float64 at the pass's width).

    Where the whole float64 matrix fits in one working chunk it is converted once and kept
    (small cohorts: no conversion per pass); a float64 ``G`` is read in place (its rows are
    never written).

    Parameters
    ----------
    G : torch.Tensor
        The rows received, [k, d], kept as given.
    n : int or None, default None
        The public number of rows (None: k); rows past k are zero.
    chunk : int or None, default None
        Rows per float64 chunk of every pass (None: as many as fit in ``WORK_BYTES``).

    Raises
    ------
    ValueError
        When ``G`` is not a matrix.
    """

    def __init__(self, G: torch.Tensor, n: int | None = None, chunk: int | None = None) -> None:
        if G.dim() != 2:
            raise ValueError(f"rows must be a matrix (n_units x d), got shape {tuple(G.shape)}")
        self.G = G
        self.received = int(G.shape[0])
        self.n = max(self.received, int(n or 0))
        self.d = int(G.shape[1])
        self.chunk = None if chunk is None else max(1, int(chunk))
        self.dtype, self.device = G.dtype, G.device
        self._full: torch.Tensor | None = None
        self._column_sum: torch.Tensor | None = None
        if G.dtype == F64 and self.received == self.n:
            self._full = G
        elif self.chunk is None and self.n * self.d * 8 <= WORK_BYTES:  # small: once
            self._full = self._convert(0, self.n)

    @property
    def shape(self) -> tuple[int, int]:
        """(n, d): the public number of rows (padding included) and their width."""
        return (self.n, self.d)

    def __len__(self) -> int:
        return self.n

    def rows_per_chunk(self, width: int | None = None) -> int:
        """Rows of one chunk of a pass whose float64 rows have ``width`` values.

        Parameters
        ----------
        width : int or None, default None
            Values per float64 row (None: d).

        Returns
        -------
        int
            Rows per chunk.
        """
        if self.chunk is not None:
            return self.chunk
        return chunk_rows(self.d if width is None else width)

    def _convert(self, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        r = stop - start
        B = torch.empty(r, self.d, dtype=F64, device=self.device) if out is None else out[:r]
        k = min(max(self.received - start, 0), r)
        if k:
            B[:k].copy_(self.G[start : start + k])
        if k < r:
            B[k:].zero_()
        return B

    def block(
        self,
        start: int,
        stop: int,
        *,
        centre: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows ``start..stop-1`` in float64 [stop-start, d] (zero rows past the received ones),
        minus ``centre`` if given. Without ``centre`` it may be a view of the stored rows: read
        it, never write it. ``out``: a float64 buffer of at least that many rows to fill.

        Parameters
        ----------
        start, stop : int
            The rows.
        centre : torch.Tensor or None, default None
            Subtracted from every row where given.
        out : torch.Tensor or None, default None
            A float64 buffer of at least ``stop - start`` rows.

        Returns
        -------
        torch.Tensor
            [stop - start, d] float64.
        """
        if self._full is not None and centre is None and out is None:
            return self._full[start:stop]
        if self._full is not None:
            B = (
                torch.empty(stop - start, self.d, dtype=F64, device=self.device)
                if out is None
                else out[: stop - start]
            )
            B.copy_(self._full[start:stop])
        else:
            B = self._convert(start, stop, out)
        if centre is not None:
            B.sub_(centre)
        return B

    def chunks(
        self, rows: int | None = None, *, centre: torch.Tensor | None = None
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """(start, float64 chunk) over all n rows, ``rows`` at a time (``rows_per_chunk()``).

        Parameters
        ----------
        rows : int or None, default None
            Rows per chunk (None: ``rows_per_chunk()``).
        centre : torch.Tensor or None, default None
            Subtracted from every row where given.

        Yields
        ------
        tuple of (int, torch.Tensor)
            The chunk's first row and its float64 rows.
        """
        step = rows or self.rows_per_chunk()
        for s in range(0, self.n, step):
            yield s, self.block(s, min(self.n, s + step), centre=centre)

    def take(
        self,
        idx: torch.Tensor,
        *,
        centre: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The float64 rows at ``idx`` (zero rows for padding), minus ``centre`` if given;
        gathered ``rows_per_chunk()`` at a time (a temporary of that many rows in the rows'
        dtype). ``out``: a float64 buffer of at least ``len(idx)`` rows to fill.

        Parameters
        ----------
        idx : torch.Tensor
            Row indices.
        centre : torch.Tensor or None, default None
            Subtracted from every row where given.
        out : torch.Tensor or None, default None
            A float64 buffer.

        Returns
        -------
        torch.Tensor
            [len(idx), d] float64.
        """
        idx = idx.to(torch.int64).to(self.device)
        m = len(idx)
        B = torch.empty(m, self.d, dtype=F64, device=self.device) if out is None else out[:m]
        src = self._full if self._full is not None else self.G
        have = src.shape[0]
        step = self.rows_per_chunk()
        for s in range(0, m, step):
            piece, part = idx[s : s + step], B[s : s + step]
            real = piece < have
            if bool(real.all()):
                part.copy_(src.index_select(0, piece))
            else:
                part.zero_()
                pos = torch.nonzero(real).squeeze(1)
                if len(pos):
                    part.index_copy_(0, pos, src.index_select(0, piece[real]).to(F64))
        if centre is not None:
            B.sub_(centre)
        return B

    def stored(self, start: int, stop: int) -> torch.Tensor:
        """The received rows ``start..stop-1`` (stop <= ``received``) as held (the owners'
        dtype, or the float64 copy of a small cohort): a view to read, never to write.

        Parameters
        ----------
        start, stop : int
            The received rows.

        Returns
        -------
        torch.Tensor
            The rows as held.
        """
        if not 0 <= start <= stop <= self.received:
            raise ValueError(f"rows {start}..{stop} outside the {self.received} received")
        src = self._full if self._full is not None else self.G
        return src[start:stop]

    def column_sum(self) -> torch.Tensor:
        """Σ_i row_i in float64 [d], accumulated chunk by chunk (``rows_per_chunk()`` rows, one
        reused buffer); computed once per ``CohortRows`` (the rows are never written)."""
        if self._column_sum is None:
            total = torch.zeros(self.d, dtype=F64, device=self.device)
            step = self.rows_per_chunk()
            buf = None if self._full is not None else self._buffer(min(step, self.n))
            for s in range(0, self.n, step):
                total += self.block(s, min(self.n, s + step), out=buf).sum(0)
            self._column_sum = total
        return self._column_sum.clone()

    def sum_rows(self, idx: torch.Tensor) -> torch.Tensor:
        """Σ of the rows at ``idx`` in float64 [d], gathered ``rows_per_chunk()`` at a time.
        All rows in order: ``column_sum()`` (the same chunks and float64 values, so the same
        sum).

        Parameters
        ----------
        idx : torch.Tensor
            Row indices.

        Returns
        -------
        torch.Tensor
            [d] float64.
        """
        if len(idx) == self.n and bool((idx == torch.arange(self.n, device=idx.device)).all()):
            return self.column_sum()
        total = torch.zeros(self.d, dtype=F64, device=self.device)
        step = self.rows_per_chunk()
        for s in range(0, len(idx), step):
            total += self.take(idx[s : s + step]).sum(0)
        return total

    def _buffer(self, rows: int) -> torch.Tensor:
        return torch.empty(max(rows, 0), self.d, dtype=F64, device=self.device)

    def working_bytes(self, width: int | None = None) -> int:
        """Bytes of one float64 chunk of a pass at ``width`` (what a pass adds to the rows)."""
        return self.rows_per_chunk(width) * (self.d if width is None else width) * 8


def as_cohort(
    G: torch.Tensor | CohortRows, n: int | None = None, chunk: int | None = None
) -> CohortRows:
    """``G`` as ``CohortRows`` (itself if it already is one).

    Parameters
    ----------
    G : torch.Tensor or CohortRows
        The rows.
    n : int or None, default None
        The public number of rows.
    chunk : int or None, default None
        Rows per chunk.

    Returns
    -------
    CohortRows
        The rows.
    """
    return G if isinstance(G, CohortRows) else CohortRows(G, n, chunk)


def pad_to_population(G: torch.Tensor, n: int) -> torch.Tensor:
    """Rows for the public n of a replace-one estimator: missing units (failed owners, NaN/inf
    rows) count as zero vectors, so n stays public
    (docs/algorithms.md#privacy-units-and-adjacency).

    Parameters
    ----------
    G : torch.Tensor
        The rows received, [m, d].
    n : int
        The public n.

    Returns
    -------
    torch.Tensor
        [max(m, n), d]: zero rows appended up to n.
    """
    if G.shape[0] < n:
        G = torch.cat([G, G.new_zeros(n - G.shape[0], G.shape[1])])
    return G

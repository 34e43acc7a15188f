"""Independent NumPy references. `keep` dispatches a method's keep set to its reference."""

from __future__ import annotations

from tests.reference import keydiff_numpy, random_numpy, rkv_numpy


def keep(method, queries, keys, *, budget, window=8, **options):
    """Kept positions [B, K, budget] of `method` from its own NumPy reference."""
    if method == "random":
        return random_numpy.keep(queries, keys, budget=budget, window=window, **options)
    if method == "keydiff":
        assert not options, options
        return keydiff_numpy.keep(queries, keys, budget=budget, window=window)
    return rkv_numpy.keep(method, queries, keys, budget=budget, window=window, **options)

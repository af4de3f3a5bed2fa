"""Deterministic seed derivation: independent-looking 31-bit seeds from tuples of integers."""
from __future__ import annotations

_MASK = (1 << 64) - 1


def mix_seed(*parts: int) -> int:
    """A seed in [0, 2**31) from ``parts`` (splitmix64 over each part): neighbouring inputs give
    unrelated outputs, and the result depends on nothing but ``parts`` (not on hashing or timing)."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (int(p) & _MASK)) & _MASK
        x = (x + 0x9E3779B97F4A7C15) & _MASK
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
        x ^= x >> 31
    return int(x & 0x7FFFFFFF)

"""Test support for routereplay users and our own tests and benchmarks (as ``torch.testing``).

Nothing in the product imports this package.

- :func:`routing_trace`: synthetic routing traces with an exact entropy rate
  (routereplay.testing.traces);
- :mod:`crafted`: crafted sidecar inputs (forged sizes, bombs, junk) for robustness tests
  and benchmarks (routereplay.testing.crafted).
"""
from routereplay.testing import crafted
from routereplay.testing.traces import routing_trace

__all__ = ["routing_trace", "crafted"]

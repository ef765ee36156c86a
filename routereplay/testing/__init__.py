"""Test support for routereplay users and our own tests and benchmarks (as ``torch.testing``).

Nothing in the product imports this package.

- :func:`routing_trace`: synthetic routing traces with an exact entropy rate
  (routereplay.testing.traces).
"""
from routereplay.testing.traces import routing_trace

__all__ = ["routing_trace"]

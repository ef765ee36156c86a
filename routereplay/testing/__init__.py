"""Test support for routereplay users and our own tests and benchmarks (as ``torch.testing``).

Nothing in the product imports this package.

- :func:`routing_trace`: synthetic routing traces with an exact entropy rate
  (routereplay.testing.traces), layers independent of each other;
- :class:`CrossLayerRouting`: a routing source whose layers depend on each other (a
  token's experts at layer l drawn given its experts at layer l - 1), records of any
  length, exact code length;

Crafted hostile streams (forged sizes, bombs, the 0.2 format-2 encoder) are test-only:
tests/crafted.py.
"""
from routereplay.testing.traces import CrossLayerRouting, routing_trace

__all__ = ["CrossLayerRouting", "routing_trace"]

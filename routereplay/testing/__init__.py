"""Test support for routereplay users and our own tests and benchmarks (as ``torch.testing``).

Nothing in the product imports this package.

- :func:`routing_trace`: synthetic routing traces with an exact entropy rate
  (routereplay.testing.traces), layers independent of each other;
- :class:`CrossLayerRouting`: a routing source whose layers depend on each other (a
  token's experts at layer l drawn given its experts at layer l - 1), records of any
  length, exact code length;
- :mod:`crafted`: crafted sidecar inputs (forged sizes, bombs, junk) for robustness tests
  and benchmarks (routereplay.testing.crafted).
"""
from routereplay.testing import crafted
from routereplay.testing.traces import CrossLayerRouting, routing_trace

__all__ = ["CrossLayerRouting", "routing_trace", "crafted"]

"""Deprecated alias of :mod:`routereplay.codec.ctx_ans` (the pre-0.2 name, kept for one release)."""
from routereplay._deprecated import alias_module

alias_module(__name__, "routereplay.codec.ctx_ans")

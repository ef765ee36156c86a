"""Format version 1 record meta (docs/FORMAT.md, "Version 1 meta"): read, never written.

Version 1 lists every meta key and gives sections as objects
``{"name", "codec", "offset", "length", "shape"}`` (routing sections also ``"layers"``).
Only streams whose header says version 1 come here.
"""
from __future__ import annotations

from typing import Any

from routereplay.schema import RoutingSchema


def sections_v1(secs: Any, num_tokens: Any, schema: RoutingSchema) -> list:
    """Version-1 section objects -> :class:`routereplay.sidecar.payload.Section` list.

    Raises:
        routereplay.sidecar.payload.MetaError: a section that is not such an object.
    """
    from routereplay.sidecar.payload import Section, MetaError, is_int
    if not isinstance(secs, list):
        raise MetaError("field 'sections' missing or not list")
    out = []
    for sec in secs:
        if not isinstance(sec, dict) or not isinstance(sec.get("name"), str):
            raise MetaError("section without a name")
        o, n, shape = sec.get("offset"), sec.get("length"), sec.get("shape")
        if not (is_int(o) and is_int(n)):
            raise MetaError(f"section {sec['name']!r} lies outside the payload")
        if not (isinstance(shape, list) and all(is_int(x) for x in shape)):
            raise MetaError(f"section {sec['name']!r} has a bad shape")
        layers = sec.get("layers")
        if sec["name"] == "routing":
            if not (isinstance(layers, list) and len(layers) == 2 and all(is_int(x) for x in layers)):
                raise MetaError(f"routing section has bad layers {layers!r}")
            layers = (layers[0], layers[1])
        else:
            layers = None
        codec = sec.get("codec")
        if not isinstance(codec, str):
            raise MetaError(f"section {sec['name']!r} without codec")
        out.append(Section(sec["name"], codec, o, n, tuple(shape), layers))
    return out

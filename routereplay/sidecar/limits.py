"""Reader limits on record payloads (docs/FORMAT.md "Reader limits"): the work and memory a
stream costs a reader are bounded by its size on disk, checked before anything is
decompressed. The writer keeps within them, so it never writes what readers refuse.
"""
from __future__ import annotations

from routereplay.schema import RoutingSchema
from routereplay.sidecar.layout import MAX_TOKENS

# NOTE: a section of a known codec decodes to at most EXPANSION[codec] x its stored bytes +
# min(EXPANSION_SLACK, EXPANSION[codec] x its stored bytes). The slack is proportional to the
# stored bytes: an absolute slack per section was granted again for every section, so a
# stream of many tiny forged sections decoded to far more than its size.
EXPANSION = {"ctx-zstd": 64, "xl-zstd": 64, "raw-lm": 1, "zstd": 64, "raw": 1}
EXPANSION_SLACK = 64 << 10             # the most slack bytes a section gets
# NOTE: a whole version-3 record decodes to at most 2 x RECORD_EXPANSION x its payload, so
# that largest_record_bytes() holds for both versions.
RECORD_EXPANSION = max(EXPANSION.values())
SECTION_OVERHEAD = 5                   # bytes of a version-3 section before its data
# NOTE: every routing section costs a fixed amount of reading (table entry, CRC, decoder
# call: 10-50 us) whatever its size, so a record's payload must hold at least SECTION_FLOOR
# bytes per routing section beyond its first (one-section records are exempt).
SECTION_FLOOR = 96
# NOTE: streams of earlier writers (before this floor) given tiny grids hold sections below
# it: readable with floors=False (trusted streams), so that nothing written before is lost
LEGACY_HINT = ("; a stream of an earlier writer (before the reader floors: tiny grids) reads "
               "with SidecarReader(..., floors=False) or `routereplay convert --from sidecar "
               "--no-floors` (trusted streams only: its CPU per MiB is then unbounded)")


def largest_record_bytes(schema: RoutingSchema, stream_bytes: int) -> int:
    """Decoded bytes (ids, token ids, log-probs) of the largest record the reader limits let
    a stream of ``stream_bytes`` bytes hold: min(format limit of ``MAX_TOKENS`` rows,
    ``2 x RECORD_EXPANSION`` x the stored bytes)."""
    fmt = MAX_TOKENS * schema.num_moe_layers * schema.top_k * schema.id_dtype.itemsize \
        + 8 * (MAX_TOKENS + 1)
    return min(fmt, 2 * RECORD_EXPANSION * stream_bytes)


def section_fits(codec: str, decoded: int, stored: int) -> bool:
    """Whether a section of ``stored`` bytes declaring ``decoded`` bytes is within
    :data:`EXPANSION`; True for codecs without a limit here (a reader refuses those by
    name: unknown or removed)."""
    r = EXPANSION.get(codec)
    return r is None or decoded <= r * stored + min(EXPANSION_SLACK, r * stored)


def record_fits(schema: RoutingSchema, decoded: int, payload_len: int) -> bool:
    """Whether a version-3 record of ``payload_len`` bytes decoding to ``decoded`` bytes is
    within the record-level limit (:data:`RECORD_EXPANSION`)."""
    return decoded <= 2 * RECORD_EXPANSION * payload_len


def grid_fits(n_routing: int, payload_len: int) -> bool:
    """Whether ``n_routing`` routing sections in ``payload_len`` bytes are at or above
    :data:`SECTION_FLOOR`."""
    return payload_len >= SECTION_FLOOR * (n_routing - 1)

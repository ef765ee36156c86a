"""Seeded, bounded fuzzing of crafted sidecar sections (issue 16): forged counts, shapes,
codecs and bombs behind valid checksums. Asserts the work, not only the error type: every
input is read (or refused with our error) within peak memory 8 MiB + 4 x the largest
record the reader limits allow for its size, and 0.25 s + 1 s per MiB of CPU."""
import time
import tracemalloc

import numpy as np
import pytest

from routereplay.errors import RouteReplayError
from routereplay.schema import RoutingSchema
from routereplay.sidecar import SidecarReader
from routereplay.sidecar.limits import largest_record_bytes
from tests import crafted

MiB = 1 << 20
SCHEMAS = [RoutingSchema(4, (1, 2, 3), 4, 16), RoutingSchema(2, (0, 1), 2, 512)]
CODECS, REMOVED = ["xl-zstd", "ctx-zstd", "raw-lm"], ["ctx-ans", "zstd-lm", "xl-ans"]


def _mutate(rng, meta, parts, schema):
    """One to three forgeries of the sizes and bytes a reader trusts least."""
    big = [0, 1, 2 ** 10, 2 ** 16, 2 ** 20, 2 ** 24, 2 ** 24 + 1, 2 ** 28, 2 ** 31]
    for _ in range(rng.integers(1, 4)):
        what = rng.integers(0, 8)
        i = int(rng.integers(0, len(parts)))
        sec = meta["sections"][i]
        if what == 0:
            meta["num_tokens"] = int(rng.choice(big))
        elif what == 1:
            meta["start"] = int(rng.choice(big))
        elif what == 2 and len(sec) == 4:
            sec[3] = int(rng.choice(big))                       # array count
        elif what == 3:
            n = int(rng.choice([1 << 16, 1 << 22, 1 << 26]))
            parts[i] = crafted.zstd_bomb(n, bytes([int(rng.integers(0, 256))]))
        elif what == 4:
            parts[i] = rng.integers(0, 256, int(rng.integers(0, 64))).astype(np.uint8).tobytes()
        elif what == 5:
            sec[1] = str(rng.choice(CODECS + REMOVED + ["zstd", "raw", "bogus"]))
        elif what == 6:
            parts[i] = parts[i][:int(rng.integers(0, len(parts[i]) + 1))]
        else:
            meta["prompt_len"] = int(rng.choice(big))


def _read_all(data):
    r = SidecarReader(data)
    for _ in r.records(strict=False):
        pass
    for sid in r.sample_ids():
        try:
            r.read(sid, tokens=(0, 1 << 30))
        except RouteReplayError:
            pass


@pytest.mark.parametrize("seed", range(4))
def test_crafted_sections_cost_in_proportion(seed):
    rng = np.random.default_rng(1000 + seed)
    worst = []
    for case in range(40):
        schema = SCHEMAS[case % 2]
        rec = crafted.record(schema, f"f{case}", int(rng.integers(2, 200)), case)
        codec = CODECS[int(rng.integers(0, len(CODECS)))]
        data = crafted.forged(schema, rec, lambda m, p: _mutate(rng, m, p, schema), codec=codec)
        tracemalloc.start()
        t = time.process_time()
        try:
            _read_all(data)
        except RouteReplayError:
            pass
        cpu = time.process_time() - t
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        mem_bound = 8 * MiB + 4 * largest_record_bytes(schema, len(data))
        cpu_bound = 0.25 + len(data) / MiB
        assert peak <= mem_bound and cpu <= cpu_bound, (case, len(data), peak, cpu)
        worst.append((peak / mem_bound, cpu / cpu_bound))
    assert max(w[0] for w in worst) < 1 and max(w[1] for w in worst) < 1

"""``routereplay export``: one sample's expert ids of a sidecar to a ``.npy`` file."""
from __future__ import annotations

import argparse
import io

from routereplay.cli.common import open_streams
from routereplay.cli.outputs import check_out, local_path, report_to, write_output
from routereplay.errors import RouteReplayError


def cmd_export(a: argparse.Namespace) -> int:
    """Write sample ``a.sample`` of ``a.sidecar`` to ``a.out``: [T, L_moe, top_k] (or
    [T, num_hidden_layers, top_k] with ``--full-layers``), the stream's id dtype."""
    import numpy as np

    from routereplay.errors import UnknownSampleError
    a.out = local_path(a.out)
    check_out(a.out, a.sidecar)
    with open_streams(a.sidecar, a) as r:
        try:
            rec = r.read(a.sample, arrays=False)
        except UnknownSampleError:
            raise RouteReplayError(f"sample {a.sample!r} is not in "
                                   f"{', '.join(a.sidecar)}") from None
        except RouteReplayError as e:           # a corrupt record: name its stream
            where = r.stream_of(a.sample) if hasattr(r, "stream_of") else r.name
            raise RouteReplayError(str(e) if where in str(e) else f"{where}: {e}") from None
        ids = rec.expert_ids
        if a.full_layers:                       # vLLM layout: dense layers zero-filled
            full = np.zeros((ids.shape[0], r.schema.num_hidden_layers, ids.shape[2]), ids.dtype)
            full[:, list(r.schema.moe_layer_ids)] = ids
            ids = full

    def save(f) -> None:
        # NOTE: through a buffer: np.save asks a real file for its position, which a pipe
        # (--out /dev/stdout | ...) has not; one record's ids
        buf = io.BytesIO()
        np.save(buf, ids, allow_pickle=False)
        f.write(buf.getbuffer())
    write_output(a.out, save)
    print(f"sample {a.sample!r}: {ids.shape[0]} tokens from position {rec.start}, "
          f"array {list(ids.shape)} {ids.dtype} -> {a.out}", file=report_to(a.out))
    return 0

"""Ask SGLang for routing and stream it into a sidecar: HTTP and offline Engine.

    client = SGLangRoutingClient("http://127.0.0.1:30000", schema, writer)
    resp, rec = client.generate({"input_ids": ids, "sampling_params": {...}})
    # multi-turn: the next turn asks only for rows not yet stored
    resp2, rec2 = client.generate({"input_ids": ids + out + user}, start_len=client.next_start(rec))

Every record is written to the sidecar as soon as its response is decoded; a response
without routing raises RecordError naming the request and the server flag.
"""
from __future__ import annotations

import copy
from typing import Any, Mapping, Sequence

from engine_patches.sglang import http
from engine_patches.sglang.records import record_from_response
from routereplay.record import RoutingRecord
from routereplay.schema import RoutingSchema


def with_routing(payload: Mapping[str, Any], start_len: int = 0) -> dict[str, Any]:
    """A copy of a ``/generate`` or OpenAI request body asking for routing.

    Sets ``return_routed_experts=True`` and ``routed_experts_start_len`` (absolute token
    position of the first row; 0 = the whole sequence). Over the OpenAI endpoints these are
    top-level body fields (the OpenAI Python client sends them through ``extra_body``).
    """
    p = copy.deepcopy(dict(payload))
    p["return_routed_experts"] = True
    p["routed_experts_start_len"] = int(start_len)
    return p


def next_start(previous: RoutingRecord) -> int:
    """The first token position whose routing ``previous`` (an earlier turn) lacks."""
    return previous.start + previous.num_tokens


class SGLangRoutingClient:
    """Requests to an SGLang server with routing on; records go to ``writer``.

    Args:
        base_url: e.g. ``http://127.0.0.1:30000``.
        schema: the served model's routing schema.
        writer: a SidecarWriter (or None to only return records).
        num_fused_shared_experts: width of fused shared-expert columns, if the server
            returns them.
    """

    def __init__(self, base_url: str, schema: RoutingSchema, writer=None, *,
                 timeout: float = 600.0, num_fused_shared_experts: int = 0):
        self.base_url, self.schema, self.writer, self.timeout = base_url, schema, writer, timeout
        self.num_fused_shared_experts = num_fused_shared_experts

    def _record(self, resp, start_len, prompt_ids, sample_id) -> RoutingRecord:
        rec = record_from_response(resp, self.schema, start_len=start_len, prompt_ids=prompt_ids,
                                   sample_id=sample_id,
                                   num_fused_shared_experts=self.num_fused_shared_experts)
        if self.writer is not None:
            self.writer.write(rec)
        return rec

    def generate(self, payload: Mapping[str, Any], *, start_len: int = 0,
                 sample_id: str | None = None) -> tuple[dict, RoutingRecord]:
        """POST /generate (one prompt); returns (response, record)."""
        body = with_routing(payload, start_len)
        resp = http.call(self.base_url, "/generate", body, timeout=self.timeout)
        ids = payload.get("input_ids")
        return resp, self._record(resp, start_len, ids if isinstance(ids, list) else None,
                                  sample_id)

    def completions(self, payload: Mapping[str, Any], *, start_len: int = 0,
                    sample_id: str | None = None, chat: bool = False) -> tuple[dict, RoutingRecord]:
        """POST /v1/completions (or /v1/chat/completions); returns (response, record)."""
        body = with_routing(payload, start_len)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        resp = http.call(self.base_url, path, body, timeout=self.timeout)
        return resp, self._record(resp, start_len, None, sample_id)


def engine_generate(engine: Any, schema: RoutingSchema, *, input_ids: Sequence[int],
                    sampling_params: Mapping[str, Any], start_len: int = 0, writer=None,
                    sample_id: str | None = None, **kw: Any) -> tuple[dict, RoutingRecord]:
    """Offline ``sglang.Engine.generate`` for one prompt with routing on.

    The engine must be built with ``enable_return_routed_experts=True``.
    """
    resp = engine.generate(input_ids=list(input_ids), sampling_params=dict(sampling_params),
                           return_routed_experts=True, routed_experts_start_len=start_len, **kw)
    rec = record_from_response(resp, schema, start_len=start_len, prompt_ids=input_ids,
                               sample_id=sample_id)
    if writer is not None:
        writer.write(rec)
    return resp, rec

"""HF transformers reference: engine-like records from an fp32 HF forward (test helper)."""
from __future__ import annotations

import numpy as np
import torch

from routereplay.record import RoutingRecord, WeightVersionSpan
from routereplay.schema import RoutingSchema


def hf_records(model_dir: str, seqs: list[list[int]], prompt_len: int, start: int = 0,
               prefix: str = "hf") -> tuple[RoutingSchema, list[RoutingRecord]]:
    """Records whose routing and log-probs come from HF Qwen3-MoE in fp32.

    ids: top-k of the softmax router in descending order, rows [start, N-1), MoE layers only.
    """
    from transformers import AutoModelForCausalLM
    schema = RoutingSchema.from_hf_config(model_dir)
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    recs = []
    with torch.no_grad():
        for i, ids in enumerate(seqs):
            x = torch.tensor([ids])
            out = m(x, output_router_logits=True)
            lp = torch.log_softmax(out.logits[0].float(), -1)[:-1].gather(-1, x[0, 1:, None])[:, 0]
            rl = [r.reshape(len(ids), -1) for r in out.router_logits if r is not None]
            assert len(rl) == schema.num_moe_layers
            topk = np.stack([torch.topk(r.float(), schema.top_k, -1).indices.numpy() for r in rl], 1)
            recs.append(RoutingRecord(
                sample_id=f"{prefix}{i}", expert_ids=topk[start:len(ids) - 1].astype(schema.id_dtype),
                start=start, prompt_len=prompt_len, token_ids=np.asarray(ids, np.int32),
                logprobs=lp[prompt_len - 1:].numpy().astype(np.float32),
                weight_versions=[WeightVersionSpan("v0", 0, len(ids))], engine="hf"))
    return schema, recs

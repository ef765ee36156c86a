"""Subprocess check: replay with per-token fallback in megatron-core (prints JSON).

usage: python tests/mcore_fallback_check.py MODEL_DIR SIDECAR
Rows before each record's start have no routing; with a perturbed router, replay must
force the recorded experts on covered rows and fall back to the model's own routing on
the others (identical to a no-replay pass there, since those positions precede every
replayed row).
"""
import json
import sys

import numpy as np
import torch

from routereplay.sidecar import SidecarReader
from trainer_hooks.megatron import hf_qwen3_moe as conv
from trainer_hooks.megatron.recompute import batch_tensors, init_single_process, token_logprobs
from trainer_hooks.megatron.replay import replay_tensors, replaying, used_topk

model_dir, sidecar = sys.argv[1], sys.argv[2]
init_single_process()
hf = conv.load_hf_config(model_dir)
model = conv.build_gpt_model(hf, conv.transformer_config(hf))
conv.load_into(model, conv.load_hf_checkpoint(model_dir), hf)
routers = [m for n, m in model.named_modules() if n.endswith("mlp.router")]
with torch.no_grad():
    g = torch.Generator().manual_seed(5)
    for r in routers:
        r.weight.add_(torch.randn(r.weight.shape, generator=g) * 0.5)
recs = list(SidecarReader(sidecar).records())
ids, pos, mask = batch_tensors(recs)
b, s = ids.shape
with torch.no_grad(), replaying(None):
    token_logprobs(model, ids, pos, mask)
    own = used_topk(s, b)
rt = replay_tensors(recs, SidecarReader(sidecar).schema, s)
with torch.no_grad(), replaying(rt):
    token_logprobs(model, ids, pos, mask)
    used = used_topk(s, b)
res = {"covered_equal": True, "fallback_equal_own": True, "covered_differs_from_own": 0,
       "fallback_rows": 0, "duplicate_rows": 0}
for j, r in enumerate(recs):
    cov = used[j, r.start:r.start + r.num_tokens]
    res["covered_equal"] &= bool((cov == r.ids.astype(np.int64)).all())
    res["covered_differs_from_own"] += int((np.sort(own[j, r.start:r.start + r.num_tokens], -1)
                                            != np.sort(cov, -1)).any(-1).sum())
    fb = used[j, :r.start]
    res["fallback_rows"] += int(fb.shape[0] * fb.shape[1])
    res["fallback_equal_own"] &= bool((fb == own[j, :r.start]).all())
srt = np.sort(used, -1)
res["duplicate_rows"] = int((srt[..., 1:] == srt[..., :-1]).any(-1).sum())
print("RESULT " + json.dumps(res))

"""routereplay for SGLang: responses -> records, request helpers, weight-sync over HTTP.

Works at SGLang's data boundary (JSON responses of ``/generate`` and the OpenAI-compatible
endpoints, or ``sglang.Engine.generate`` dicts), so importing it needs no SGLang install.
Payload conventions are those of SGLang 0.5.7 to 0.5.23 (``meta_info["routed_experts"]``:
base64 of raw little-endian int32, ``[seqlen - 1 - start_len, num_hidden_layers, top_k]``;
``weight_versions`` spans and ``num_retractions`` from 0.5.2x).
"""

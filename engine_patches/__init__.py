"""Engine-side integrations of routereplay: vllm/ (and sglang/). Imports the core only."""

"""Trainer-side integrations of routereplay: core/ (what every replayer shares), megatron/ (the product), hf/ (the reference for verify). Imports the routereplay core only."""

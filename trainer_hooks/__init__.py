"""Trainer-side integrations of routereplay: megatron/ (the product). Imports the core only."""

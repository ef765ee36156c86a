"""What every trainer's replayer shares, free of any trainer framework (torch and the
routereplay core only): the microbatch map and its checks (``microbatch``), the loader that
decodes ahead on a thread (``prefetch``), the per-step statistics (``stats``) and the replay
errors (``errors``). trainer_hooks.megatron and trainer_hooks.fsdp build on it; importing it
imports neither megatron-core nor transformers.
"""

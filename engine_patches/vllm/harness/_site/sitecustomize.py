# Loaded at interpreter start-up in processes started with
# engine_patches.vllm.harness.triton_cpu.engine_env(): installs the Triton interpreter shim
# before vLLM is imported. Does nothing on machines with CUDA.
try:
    from engine_patches.vllm.harness.triton_cpu import install as _install
    _install()
except Exception as _e:  # noqa: BLE001 - never break interpreter start-up
    import sys
    print(f"routereplay: Triton CPU shim not installed: {_e!r}", file=sys.stderr)

"""A framework's own vLLM worker extension (verl, NeMo-RL and OpenRLHF each ship one), with
routereplay's worker methods added by ``with_routereplay``: the engine in
tests/vllm_engine_checks.py runs with ``worker_extension_cls="tests.vllm_third_party_ext.
WorkerExtension"``, so every routereplay weight-sync call there goes through the composed
class, next to the framework's own methods."""
from engine_patches.vllm.worker_extension import with_routereplay


class FrameworkWorkerExtension:
    """Stands for a framework's extension: its own RPC methods and update path."""

    def framework_ping(self) -> list:
        """The worker's classes (vLLM mixes the extension into its worker class)."""
        return [c.__name__ for c in type(self).__mro__]

    def framework_update(self, path: str) -> None:
        """The framework's own update path (here: vLLM's reload from a folder)."""
        self.reload_weights(weights_path=path)


WorkerExtension = with_routereplay(FrameworkWorkerExtension)

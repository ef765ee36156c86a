"""The cache salt naming the weight version on every request a vLLM engine admits, so that
a request after an update never hits a prefix-cache block computed under other weights
(:mod:`engine_patches.vllm.weight_sync`); one per engine, shared by every sync."""
from __future__ import annotations

import weakref
from typing import Any

SALT_PREFIX = "routereplay-weight-version="


class _VersionSalt:
    """Adds ``routereplay-weight-version=<v>`` to the cache salt of every request the
    engine's input processor admits (instance attributes of that one processor; the
    synchronous and the async entry point, which vLLM binds at construction); after a reload
    under the same label (``reload_same_version``) also the reload count:
    ``routereplay-weight-version=<v>#reload-<n>``."""

    def __init__(self, input_processor: Any):
        self.ip = input_processor
        self.version: str | None = None
        self.reloads = 0
        self._saved: dict[str, Any] | None = None
        self.users = 0

    def set(self, version: str, *, update: bool = False) -> None:
        """Salt new requests with ``version``; ``update``: new weights come with it (under
        the label already salted, only after a check allowed that: a reload)."""
        if version != self.version:
            self.version, self.reloads = version, 0
        elif update:
            self.reloads += 1

    def tag(self) -> str | None:
        """The salt new requests get (None: none yet)."""
        if self.version is None:
            return None
        return f"{SALT_PREFIX}{self.version}" + (f"#reload-{self.reloads}" if self.reloads else "")

    def _salted(self, req: Any) -> Any:
        tag = self.tag()
        if tag is not None and hasattr(req, "cache_salt"):
            base = req.cache_salt or ""
            req.cache_salt = f"{base}|{tag}" if base else tag
        return req

    def install(self) -> None:
        if self._saved is not None:
            return
        ip = self.ip
        self._saved = {n: ip.__dict__.get(n) for n in ("process_inputs", "process_inputs_async")}
        sync_fn = ip.process_inputs
        async_fn = getattr(ip, "process_inputs_async", None)

        def process_inputs(*a, **k):
            return self._salted(sync_fn(*a, **k))
        ip.process_inputs = process_inputs
        if async_fn is not None:
            async def process_inputs_async(*a, **k):
                return self._salted(await async_fn(*a, **k))
            ip.process_inputs_async = process_inputs_async

    def uninstall(self) -> None:
        if self._saved is None:
            return
        for name, old in self._saved.items():
            if old is None:
                self.ip.__dict__.pop(name, None)
            else:
                setattr(self.ip, name, old)
        self._saved = None


_SALTS: "weakref.WeakKeyDictionary[Any, _VersionSalt]" = weakref.WeakKeyDictionary()


def _input_processor(engine: Any) -> Any:
    ip = getattr(engine, "input_processor", None)
    return ip if ip is not None else engine.llm_engine.input_processor


def _salt(engine: Any) -> _VersionSalt:
    """The engine's one version salt (installed on first use)."""
    ip = _input_processor(engine)
    s = _SALTS.get(ip)
    if s is None:
        s = _SALTS[ip] = _VersionSalt(ip)
        s.install()
    return s

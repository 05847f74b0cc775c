"""An emulated vLLM engine: pure scheduler core, step-time profiles and an OpenAI HTTP server.

The HTTP names load lazily so that an offline simulator importing the core does not pay for
aiohttp.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway_lab.engine.model import EngineCore, FinishedRequest, StepResult
from gateway_lab.engine.profiles import PROFILES, EngineProfile, get_profile

if TYPE_CHECKING:
    from gateway_lab.engine.server import DEFAULT_MODEL, EngineServer, running_engine

__all__ = [
    "DEFAULT_MODEL",
    "PROFILES",
    "EngineCore",
    "EngineProfile",
    "EngineServer",
    "FinishedRequest",
    "StepResult",
    "get_profile",
    "running_engine",
]

_LAZY = frozenset({"DEFAULT_MODEL", "EngineServer", "running_engine"})


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from gateway_lab.engine import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

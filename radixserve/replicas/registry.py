"""Where the ingress finds the router Ray built for it.

Ray builds request routers itself, inside its handle machinery, from a copy of the router's
module (it pickles that module by value), so the registry cannot live there: a router registers
here, under the key the ingress passed in request_router_kwargs. Weak: a router's lifetime
stays Ray's.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

_ROUTERS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
_LOCK = threading.Lock()


def register(key: str, router: Any) -> None:
    with _LOCK:
        _ROUTERS[key] = router


def router_for(key: str) -> Any | None:
    """The router registered under `key` (None until Ray has built it: at the first call)."""
    with _LOCK:
        return _ROUTERS.get(key)

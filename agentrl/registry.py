"""Name -> implementation registries (recipes, advantage estimators, losses, filters, task samplers, envs),
all of one shape: a new method is a decorator in any module, and a wrong name fails with the allowed ones.

A name is either registered or an import path ``package.module:object``, so a user's code is used from
the user's own module with no edit of this package (``algo.estimator: mypkg.mod:my_advantages``). A user's
module that registers names (``register_env("guess", ...)``) is imported before the first lookup when it
is listed in ``$AGENTRL_PLUGINS`` (comma-separated modules; ``agentrl --import mypkg.mod`` appends to it,
and worker processes inherit it) or declared as a package entry point in the group ``agentrl.plugins``.
"""
from __future__ import annotations

import importlib
import os
import threading
from typing import Any, Callable

PLUGINS_VAR = "AGENTRL_PLUGINS"
ENTRY_POINT_GROUP = "agentrl.plugins"
_loaded: set[str] = set()
_plugins_lock = threading.RLock()


class RegistryError(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


def import_module(name: str, why: str) -> Any:
    """``importlib.import_module`` with one readable line when it fails (``why``: who asked for it)."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise RegistryError(f"{why}: cannot import '{name}': {e} (is its folder on PYTHONPATH, or the package "
                            "installed?)") from None


def load_object(path: str, kind: str) -> Any:
    """The object at ``package.module:attr`` (``attr`` may be dotted: ``mod:Class.method``)."""
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise RegistryError(f"{kind} '{path}': an import path must look like package.module:name")
    obj = import_module(module, f"{kind} '{path}'")
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RegistryError(f"{kind} '{path}': module '{module}' has no '{attr}'")
        obj = getattr(obj, part)
    return obj


def plugin_modules() -> list[str]:
    return [m.strip() for m in os.environ.get(PLUGINS_VAR, "").split(",") if m.strip()]


def add_plugin(module: str) -> None:
    """Import ``module`` now and list it in ``$AGENTRL_PLUGINS``, so processes started from here (env
    workers, ranks) import it too."""
    if module not in plugin_modules():
        os.environ[PLUGINS_VAR] = ",".join(plugin_modules() + [module])
    load_plugins()


def load_plugins() -> None:
    """Import the user's modules that register names: ``$AGENTRL_PLUGINS``, then the ``agentrl.plugins``
    entry points of installed packages; each once per process."""
    with _plugins_lock:
        for name in plugin_modules():
            if name not in _loaded:
                _loaded.add(name)
                try:
                    import_module(name, f"${PLUGINS_VAR}")
                except BaseException:
                    _loaded.discard(name)  # asked again at the next lookup, and failing again
                    raise
        if "entry points" not in _loaded:
            _loaded.add("entry points")
            from importlib.metadata import entry_points

            for ep in entry_points(group=ENTRY_POINT_GROUP):
                try:
                    ep.load()
                except ImportError as e:
                    raise RegistryError(f"plugin '{ep.name}' ({ep.value}, entry point group {ENTRY_POINT_GROUP}): "
                                        f"cannot import: {e}") from None


class Registry:
    def __init__(self, kind: str, fill: str = "", coerce: Callable[[str, Any], Any] | None = None):
        """``fill``: the module whose import registers the built-in entries (``agentrl.recipes`` for the
        recipes), imported at the first lookup, so a caller never imports it just to fill the registry.
        ``coerce(name, obj)``: what an object loaded by import path becomes (a bare function -> an
        ``Estimator``)."""
        self.kind, self._fill, self._coerce = kind, fill, coerce
        self._items: dict[str, Any] = {}

    def _filled(self) -> dict[str, Any]:
        if self._fill:
            importlib.import_module(self._fill)  # a failing import raises here, and again at the next lookup
            self._fill = ""
        load_plugins()
        return self._items

    def register(self, name: str, replace: bool = False) -> Callable[[Any], Any]:
        """A decorator adding ``obj`` as ``name``; another object under a taken name is refused unless
        ``replace``."""
        def deco(obj: Any) -> Any:
            if not replace and name in self._items and self._items[name] is not obj:
                raise RegistryError(f"{self.kind} '{name}' is already registered")
            self._items[name] = obj
            return obj

        return deco

    def get(self, name: str) -> Any:
        """A registered name, or an import path ``package.module:name``."""
        if name not in self._filled():
            if ":" in name:
                obj = load_object(name, self.kind)
                return self._coerce(name, obj) if self._coerce is not None else obj
            raise RegistryError(f"unknown {self.kind} '{name}'; allowed: {', '.join(sorted(self._items))} "
                                "(or an import path package.module:name)")
        return self._items[name]

    def registered(self, name: str) -> Any:
        """What ``name`` is registered to now, or None (no plugin import: safe while modules register)."""
        return self._items.get(name)

    def items(self) -> dict[str, Any]:
        """Every registered name and its object, in registration order."""
        return dict(self._filled())

    def names(self) -> list[str]:
        return sorted(self._filled())

    def __contains__(self, name: str) -> bool:
        """Registered (an import path is not ``in`` the registry: ``get`` loads it)."""
        return name in self._filled()

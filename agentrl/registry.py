"""Name -> implementation registries (advantage estimators, losses, filters, recipes), so a new method is
a new file with a decorator, and a wrong name fails with the list of allowed ones."""
from __future__ import annotations

from typing import Any, Callable


class RegistryError(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


class Registry:
    def __init__(self, kind: str, fill: str = ""):
        """``fill``: the module whose import registers the built-in entries (``agentrl.recipes`` for the
        recipes), imported at the first lookup, so a caller never imports it just to fill the registry."""
        self.kind, self._fill = kind, fill
        self._items: dict[str, Any] = {}

    def _filled(self) -> dict[str, Any]:
        if self._fill:
            import importlib

            importlib.import_module(self._fill)  # a failing import raises here, and again at the next lookup
            self._fill = ""
        return self._items

    def register(self, name: str) -> Callable[[Any], Any]:
        def deco(obj: Any) -> Any:
            if name in self._items and self._items[name] is not obj:
                raise RegistryError(f"{self.kind} '{name}' is already registered")
            self._items[name] = obj
            return obj

        return deco

    def get(self, name: str) -> Any:
        if name not in self._filled():
            raise RegistryError(f"unknown {self.kind} '{name}'; allowed: {', '.join(sorted(self._items))}")
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._filled())

    def __contains__(self, name: str) -> bool:
        return name in self._filled()

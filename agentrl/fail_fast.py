"""One rank's error ends every rank, whether the run is driven by ``agentrl train`` or from Python.

``Trainer.__init__``, ``train`` and ``evaluate`` run under :func:`fails_every_rank`, and the trainer's
``__exit__`` hands an error raised in the ``with`` block the same way: under several ranks the failing
rank prints its error and tells the others through the rendezvous store (``agentrl.dist``), every rank
stops its servers and workers and exits, and none waits at a collective for it. In one process the error
is raised as it is.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

from agentrl import dist

F = TypeVar("F", bound=Callable[..., Any])


def says_it_all(e: BaseException) -> bool:
    """An error whose message names the key, env or server to fix: printed as one line, no traceback."""
    from agentrl.checkpoint import RunError
    from agentrl.envs.base import EnvError
    from agentrl.generation.client import GenerationServerError
    from agentrl.learner.models import ModelError
    from agentrl.registry import RegistryError
    from agentrl.schema import ConfigError

    return isinstance(e, (ConfigError, EnvError, GenerationServerError, ModelError, RegistryError, RunError))


def fail_every_rank(e: BaseException, cleanup: Callable[[], Any] | None) -> None:
    """``e`` was raised on this rank: end every rank with it (returns only in one process)."""
    if isinstance(e, SystemExit) and not e.code:  # a clean exit is no failure
        return
    dist.fail_every_rank(e, cleanup=cleanup, plain=says_it_all(e))


def fails_every_rank(method: F) -> F:
    """A trainer method whose error ends every rank: the peer watcher runs (``cleanup``: the trainer's
    ``close``), and an error here is announced to the other ranks before this rank exits."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        dist.watch_peers(cleanup=self.close)
        try:
            return method(self, *args, **kwargs)
        except BaseException as e:
            fail_every_rank(e, self.close)
            raise

    return run  # type: ignore[return-value]

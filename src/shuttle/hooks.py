"""One hook interface for everything that attaches to a module (dynamic adapters, streaming).

A :class:`ModuleHook` sees a module's calls at three points: ``pre_forward`` (may rewrite the
arguments), ``forward`` (runs the module's original forward, or replaces it) and ``post_forward``
(may rewrite the output). :func:`add_hook` installs hooks by setting an instance attribute
``forward`` that wraps the class's; :func:`remove_hook` deletes it again, so the module is exactly
what it was: same class, same ``forward``, same signature (``inspect.signature`` follows
``__wrapped__`` while hooked).

Several hooks on one module chain in the order they were added: pre_forward first to last,
forward nested (the first added is outermost), post_forward last to first. A hook added with
``outermost=True`` goes to the front of the chain instead (streaming hooks, which must bind a
module's weights before any other hook reads them).
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from shuttle.errors import ShuttleError

__all__ = ["HookGroup", "ModuleHook", "add_hook", "hooks_of", "remove_hook", "substituted"]

_HOOKS = "_shuttle_hooks"


class ModuleHook:
    """Base class: override what you need. Every method's default does nothing."""

    def on_attach(self, module: torch.nn.Module) -> None:
        """Called once by :func:`add_hook`, before the first forward."""

    def pre_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict
                    ) -> tuple[tuple, dict]:
        """Return the (possibly rewritten) arguments."""
        return args, kwargs

    def forward(self, module: torch.nn.Module, inner: Callable[..., Any], *args: Any,
                **kwargs: Any) -> Any:
        """Compute the output; ``inner`` runs the original forward (and inner hooks)."""
        return inner(*args, **kwargs)

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        """Return the (possibly rewritten) output."""
        return output

    def on_detach(self, module: torch.nn.Module) -> None:
        """Called once by :func:`remove_hook`, after the hook stopped being called."""


def hooks_of(module: torch.nn.Module) -> list[ModuleHook]:
    """The hooks installed on ``module``, in the order they were added."""
    return list(module.__dict__.get(_HOOKS, ()))


def add_hook(module: torch.nn.Module, hook: ModuleHook, outermost: bool = False) -> None:
    """Install ``hook`` on ``module``: after any hooks already there, or before them all when
    ``outermost``.
    """
    hooks: list[ModuleHook] | None = module.__dict__.get(_HOOKS)
    if hooks is None:
        if "forward" in module.__dict__:
            raise ShuttleError(
                f"{type(module).__name__} already has an instance-level forward (another "
                "library's hook?); remove it before attaching shuttle hooks"
            )
        hooks = []
        module.__dict__[_HOOKS] = hooks
        cls_forward = type(module).forward

        # Bound to the module as a method, not closed over it: copy.deepcopy of a hooked model
        # rebinds the method to the copy (with the copy's hooks), where a closure would keep
        # calling the original module.
        @functools.wraps(cls_forward)
        def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            chain = self.__dict__[_HOOKS]
            for h in chain:
                args, kwargs = h.pre_forward(self, args, kwargs)
            # a partial, not cls_forward.__get__(self): Dynamo before torch 2.13 cannot trace
            # a function's __get__ and would break the graph at every hooked module
            call: Callable[..., Any] = functools.partial(cls_forward, self)
            for h in reversed(chain):
                call = functools.partial(h.forward, self, call)
            out = call(*args, **kwargs)
            for h in reversed(chain):
                out = h.post_forward(self, out)
            return out

        module.forward = types.MethodType(forward, module)
    if hook in hooks:
        raise ShuttleError("this hook is already attached to the module")
    hook.on_attach(module)
    if outermost:
        hooks.insert(0, hook)
    else:
        hooks.append(hook)


def remove_hook(module: torch.nn.Module, hook: ModuleHook | None = None) -> None:
    """Remove ``hook`` (or every shuttle hook) from ``module``; the last one restores it."""
    hooks: list[ModuleHook] | None = module.__dict__.get(_HOOKS)
    if not hooks:
        return
    for h in list(hooks) if hook is None else [hook]:
        if h in hooks:
            hooks.remove(h)
            h.on_detach(module)
    if not hooks:
        del module.__dict__[_HOOKS]
        del module.__dict__["forward"]


class HookGroup:
    """Hooks installed together and removed together: the last installed is removed first, so
    modules end exactly as they were (see :func:`remove_hook`).
    """

    def __init__(self) -> None:
        self._installed: list[tuple[torch.nn.Module, ModuleHook]] = []

    def add(self, module: torch.nn.Module, hook: ModuleHook, outermost: bool = False) -> None:
        """:func:`add_hook`, remembered for :meth:`remove_all`."""
        add_hook(module, hook, outermost)
        self._installed.append((module, hook))

    def remove_all(self) -> None:
        """Remove every hook this group installed, in reverse order."""
        while self._installed:
            remove_hook(*self._installed.pop())

    def __len__(self) -> int:
        return len(self._installed)


@contextlib.contextmanager
def substituted(module: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Inside the block, ``module``'s own parameters named in ``tensors`` (leaf names, such as
    ``"weight"``) read as those tensors; afterwards the same parameter objects are back, in
    their order, whatever the block raised.

    For a forward that must see another value of a weight (``W + R``, a device copy) without
    changing the parameter: the entry of the module's parameter table is swapped, the
    parameter object itself is neither replaced nor written.

    Raises:
        ShuttleError: a name that is not one of ``module``'s own parameters (a buffer, a
            child's parameter, an unknown name); nothing was swapped.
    """
    table = module._parameters
    buffers = [n for n in tensors if n not in table and n in module._buffers]
    if buffers:
        raise ShuttleError(
            f"{buffers} of {type(module).__name__} are buffers, not parameters; substituted "
            "swaps parameters only (a buffer's entry would become a second tensor of that "
            "name). Pass parameter names, or assign the buffer itself.")
    missing = [n for n in tensors if n not in table]
    if missing:
        raise ShuttleError(f"{type(module).__name__} has no parameter(s) {missing} of its own "
                           f"(it has {list(table)})")
    saved = {n: table[n] for n in tensors}
    try:
        for n, t in tensors.items():
            table[n] = t
        yield
    finally:
        table.update(saved)

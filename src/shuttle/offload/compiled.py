"""``torch.compile`` of block forwards, with the weight loading kept outside the graph.

Each block gets one more hook, added after the streaming hook (so it is inner to it): the
streaming hook loads and binds the block's weights eagerly, then this hook calls the compiled
*class* forward with the block as its first argument. One compiled function serves every
block of a class: dynamo treats the module's parameters as graph inputs
(``inline_inbuilt_nn_modules``), so a block whose parameters were re-pointed at another slot,
or another block of the same class and shapes, reuses the graph instead of recompiling.
``dynamic=False``: block groups of different widths each compile once, with static shapes,
and so do the differing blocks of one group (T5's first block, with its relative attention
table, gets a graph of its own; a UNet stage list one per width). Dynamo keeps at most
``torch._dynamo.config.recompile_limit`` graphs per class: blocks of one class in more shapes
than that run the rest eagerly (dynamo warns).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from shuttle.hooks import HookGroup, ModuleHook, hooks_of

__all__ = ["BlockCompiler"]

CompileBackend = str | Callable[..., Any]


class _CompiledForward(ModuleHook):
    def __init__(self, compiled: Callable[..., Any]):
        self.compiled = compiled  # the block class's forward, compiled

    def forward(self, module: torch.nn.Module, inner: Callable[..., Any], *args: Any,
                **kwargs: Any) -> Any:
        # Replacing `inner` is only right when it is the class forward itself: no hook was
        # added inside this one (the last hook of a module is its innermost).
        assert hooks_of(module)[-1] is self, \
            "the compile hook must be the innermost hook of its block"
        return self.compiled(module, *args, **kwargs)


class BlockCompiler:
    """Compiled forwards for blocks: one ``torch.compile`` per block class.

    Args:
        backend: ``torch.compile``'s backend (``"inductor"``, ``"aot_eager"``, a callable).
    """

    def __init__(self, backend: CompileBackend = "inductor"):
        self.backend = backend
        self._compiled: dict[type, _CompiledForward] = {}
        self._hooks = HookGroup()

    def attach(self, blocks: Sequence[torch.nn.Module]) -> None:
        """Route each block's forward through its class's compiled forward (exact detach)."""
        for block in blocks:
            cls = type(block)
            hook = self._compiled.get(cls)
            if hook is None:
                compiled = torch.compile(cls.forward, backend=self.backend, dynamic=False)
                hook = self._compiled[cls] = _CompiledForward(compiled)
            self._hooks.add(block, hook)

    def detach(self) -> None:
        """Remove every hook this compiler installed; the compiled code is dropped with it."""
        self._hooks.remove_all()
        self._compiled.clear()

"""``shuttle.scaled_stream``: a streamed response whose ``lora_scale`` stays its own.

A generator runs in its caller's :mod:`contextvars` context (Python gives generators no context
of their own), so a :func:`~shuttle.lora_scale` scope opened inside one has two faults:

- while the generator is paused at a ``yield`` inside the scope, its caller, and every other
  request the caller's thread or task runs meanwhile, see the generator's scale;
- a generator stepped in a fresh copy of the context each time (Starlette's
  ``StreamingResponse`` steps a plain generator through anyio's thread pool so) loses its scale
  after the first step, and closing the scope raises ``ValueError`` (its token belongs to
  another context).

:func:`scaled_stream` runs every step of the generator (``next``, ``send``, ``throw``,
``close``; for an async generator each step of ``asend``, ``athrow``, ``aclose``) with
:meth:`contextvars.Context.run` in one context of its own: a copy of the context it was wrapped
in, taken once. Scopes the generator opens then hold in its own steps only, from whichever
thread or task steps it, and close where they opened even when the stream is dropped early
(the wrapper's own close, at ``break`` or garbage collection, closes the generator inside that
context).

What it does not change: the scale that ``torch.compile``d code and CUDA graphs read is one
tensor per device for the whole process (:mod:`shuttle.apply.scale`), and a scope opened inside
a wrapped generator writes it as any other scope does.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator
from typing import Any, TypeVar

from shuttle.errors import InvalidOptionError

__all__ = ["scaled_stream"]

_Stream = TypeVar("_Stream", bound=Generator | AsyncGenerator | Callable[..., Any])


def scaled_stream(stream: _Stream) -> _Stream:
    """Run a generator (or async generator) in a context of its own, so that a
    :func:`~shuttle.lora_scale` it opens holds in its own steps only.

    ``stream`` may be a generator, an async generator, or a function returning one (use it as a
    decorator); the context is copied when the generator is wrapped (a decorated function: at
    each call), so the stream starts from the scale in force there::

        @shuttle.scaled_stream
        def tokens(prompt, scale):
            with shuttle.lora_scale(scale):
                for step in range(n):
                    yield model(...)     # the caller runs at its own scale meanwhile

        return StreamingResponse(tokens(prompt, 0.6))

    Args:
        stream: a generator, an async generator, or a callable that returns one.

    Returns:
        A generator (async generator) that yields, receives, raises and returns what
        ``stream`` does, each of its steps run in the stream's own context; for a callable, a
        function with its signature that returns such a generator.

    Raises:
        InvalidOptionError: ``stream`` is none of those (a callable: its result is not).
    """
    if isinstance(stream, Generator):
        return _steps(stream, contextvars.copy_context())  # type: ignore[return-value]
    if isinstance(stream, AsyncGenerator):
        return _async_steps(stream, contextvars.copy_context())  # type: ignore[return-value]
    if callable(stream):
        @functools.wraps(stream)
        def call(*args: Any, **kwargs: Any) -> Generator | AsyncGenerator:
            out = stream(*args, **kwargs)
            if not isinstance(out, Generator | AsyncGenerator):
                raise InvalidOptionError(
                    f"scaled_stream({_name(stream)}): the call returned "
                    f"{type(out).__name__}, not a generator; decorate a function that yields")
            return scaled_stream(out)

        return call  # type: ignore[return-value]
    raise InvalidOptionError(
        f"scaled_stream got {type(stream).__name__}; pass a generator, an async generator, "
        "or a function that returns one (as a decorator)")


def _name(f: Callable[..., Any]) -> str:
    return getattr(f, "__qualname__", None) or repr(f)


def _steps(gen: Generator, ctx: contextvars.Context) -> Generator:
    """``yield from gen`` (PEP 380's expansion), each step of ``gen`` run in ``ctx``."""
    step: Callable[[Any], Any] = gen.send
    arg: Any = None
    try:
        while True:
            try:
                item = ctx.run(step, arg)
            except StopIteration as stop:
                return stop.value
            try:
                arg, step = (yield item), gen.send
            except GeneratorExit:
                raise  # closed: the finally closes gen in its context
            except BaseException as e:  # thrown in: on into gen
                arg, step = e, gen.throw
    finally:
        ctx.run(gen.close)


async def _async_steps(agen: AsyncGenerator, ctx: contextvars.Context) -> AsyncGenerator:
    """``_steps`` for an async generator: each step of each awaitable run in ``ctx``."""
    step: Callable[[Any], Awaitable] = agen.asend
    arg: Any = None
    try:
        while True:
            try:
                item = await _InContext(ctx, step(arg))
            except StopAsyncIteration:
                return
            try:
                arg, step = (yield item), agen.asend
            except GeneratorExit:
                raise
            except BaseException as e:
                arg, step = e, agen.athrow
    finally:
        await _InContext(ctx, agen.aclose())


class _InContext:
    """An awaitable that drives ``awaitable`` one step at a time inside ``ctx``: what it waits
    on goes out to the caller's event loop, and what comes back goes in, each in ``ctx``.
    """

    def __init__(self, ctx: contextvars.Context, awaitable: Awaitable):
        self._ctx, self._awaitable = ctx, awaitable

    def __await__(self) -> Generator[Any, Any, Any]:
        it = self._awaitable.__await__()
        step: Callable[[Any], Any] = it.send
        arg: Any = None
        while True:
            try:
                signal = self._ctx.run(step, arg)
            except StopIteration as stop:
                return stop.value
            try:
                arg, step = (yield signal), it.send
            except GeneratorExit:
                self._ctx.run(it.close)
                raise
            except BaseException as e:  # a cancellation, thrown in by the caller's task
                arg, step = e, it.throw

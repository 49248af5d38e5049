"""Offload whole diffusers pipelines and transformers models through shuttle.

Import the submodule you need; each imports its library only when used, and a missing library
raises :class:`~shuttle.errors.MissingDependencyError` naming the package to install::

    from shuttle.integrations import diffusers as shuttle_diffusers
    handle = shuttle_diffusers.offload(pipe, max_host_bytes=40 * 2**30)

This package imports neither diffusers nor transformers itself.
"""

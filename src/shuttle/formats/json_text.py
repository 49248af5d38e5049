"""JSON text that shuttle reads besides safetensors headers (``adapter_config.json``, a
``*.safetensors.index.json``, diffusers' ``lora_adapter_metadata`` entry, a ``--mapping`` file):
parsed by ``json.loads``, with a bound on nesting.

``json.loads`` recurses once per level: a file of ``[[[[...`` raises ``RecursionError``, and one
just shallow enough to parse can still make the code that reads it (a ``repr`` in a message)
recurse past the limit. No file of these kinds nests more than a few levels.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MAX_JSON_DEPTH", "load_json"]

MAX_JSON_DEPTH = 64


def load_json(text: str | bytes) -> Any:
    """``json.loads(text)``, refusing nesting deeper than :data:`MAX_JSON_DEPTH` levels.

    Raises:
        ValueError: the text is not JSON (``json.JSONDecodeError``, ``UnicodeDecodeError``), or
            nests too deep; the message says which.
    """
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"nests arrays or objects deeper than Python's JSON parser can go "
                         f"(at most {MAX_JSON_DEPTH} levels are read)") from None
    depth, level = 0, [value]
    while True:  # breadth first, one list per level: no recursion
        containers = [v for v in level if isinstance(v, (list, dict))]
        if not containers:
            return value
        depth += 1
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"nests arrays or objects more than {MAX_JSON_DEPTH} levels deep")
        level = [c for v in containers for c in (v.values() if isinstance(v, dict) else v)]

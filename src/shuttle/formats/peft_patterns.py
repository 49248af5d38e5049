"""PEFT's ``rank_pattern``/``alpha_pattern`` keys, matched as PEFT matches them, in linear time.

PEFT runs ``re.match(rf"(.*\\.)?({key})$", name)`` (``peft.utils.other.get_pattern_key``).
Python's ``re`` backtracks: ``(a+)+$`` or ``(a|aa)+b`` take time exponential in the name's
length, ``a*a*a*a*b`` a high power of it, and the keys come from the file being read. So the
same formatted pattern is parsed here (Python's own syntax: the key may even close PEFT's
group) into a Thompson automaton and run as a set of states, one step per character of the
name: O(len(name) x states), whatever the pattern. Greediness does not change whether a
match exists, so the answer is ``re``'s.

Accepted: every construct a finite automaton runs: characters and escapes (``\\d``, ``\\w``,
``\\.``, ``\\x41``, ...), classes (``[qkv]``, ``[^.]``), ``.``, groups (capturing, named,
``(?:...)``), ``|``, ``*``, ``+``, ``?``, ``{m}``, ``{m,n}`` (greedy or lazy), ``^``, ``$``,
``\\A``, ``\\Z``, ``\\b``, ``\\B``. One character (or class) and one zero-width assertion are
each tested by ``re`` itself, so they mean exactly what they mean to PEFT.

``target_modules`` given as one string is run by PEFT as ``re.fullmatch(key, name)``:
``compile_key(key, whole=True)`` matches that, the same way.

Refused (:class:`~shuttle.errors.AdapterFormatError`): what no automaton runs without
backtracking (backreferences, lookarounds, conditionals, atomic groups, possessive
quantifiers), inline flags, keys longer than :data:`MAX_KEY_CHARS`, groups nested deeper than
:data:`MAX_DEPTH`, and automata over :data:`MAX_STATES` states (``{m,n}`` copies its operand
``n`` times).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable

from shuttle.errors import AdapterFormatError

__all__ = ["MAX_DEPTH", "MAX_KEY_CHARS", "MAX_STATES", "PatternKey", "compile_key"]

MAX_KEY_CHARS = 1000
MAX_DEPTH = 32
MAX_STATES = 4096

_SPECIAL = set("\\^$.|?*+()[]{}")
_HEX = {"x": 2, "u": 4, "U": 8}
_OCTAL = "01234567"
_PREFIX = r"(.*\.)?("  # PEFT's pattern around the key: (.*\.)?(key)$
_BRACES = re.compile(r"\{([0-9]*)(,([0-9]*))?\}")  # re's DIGITS are ASCII


class _Refused(Exception):
    """A construct outside the accepted syntax: (what, its index in the formatted pattern or
    None).
    """


# The automaton: state i is ("char", test, next), ("split", next, next), ("assert", test, next)
# or ("match",). A char test takes one character; an assertion test takes (name, position).
_State = tuple


@dataclasses.dataclass(frozen=True)
class PatternKey:
    """One pattern key, ready to match module names.

    Attributes:
        key: the key as the config spells it.
    """

    key: str
    _plain: bool
    _whole: bool
    _states: tuple[_State, ...]
    _start: int

    def matches(self, name: str) -> bool:
        """``re.match(rf"(.*\\.)?({key})$", name) is not None`` (``re.fullmatch(key, name)``
        for a key compiled ``whole``), in O(len(name) x states).
        """
        if self._plain and self._whole:
            return name == self.key
        if self._plain:  # the name or a dotted suffix of it
            return any(_ends_with(text, self.key) for text in
                       (name, *([name[:-1]] if name.endswith("\n") else [])))
        states = self._states
        current = self._closure([self._start], name, 0)
        for pos, ch in enumerate(name):
            if any(states[s][0] == "match" for s in current):
                return True
            step = [states[s][2] for s in current if states[s][0] == "char" and states[s][1](ch)]
            if not step:
                return False
            current = self._closure(step, name, pos + 1)
        return any(states[s][0] == "match" for s in current)

    def _closure(self, todo: list[int], name: str, pos: int) -> list[int]:
        """The char and match states reached from ``todo`` without reading a character."""
        seen: set[int] = set()
        out = []
        while todo:
            s = todo.pop()
            if s in seen:
                continue
            seen.add(s)
            state = self._states[s]
            if state[0] == "split":
                todo += [state[2], state[1]]
            elif state[0] == "assert":
                if state[1](name, pos):
                    todo.append(state[2])
            else:
                out.append(s)
        return out


@functools.lru_cache(maxsize=1024)
def compile_key(key: str, where: str = "adapter_config.json", *, whole: bool = False
                ) -> PatternKey:
    """Parse a ``rank_pattern``/``alpha_pattern`` key (see the module docstring).

    Args:
        key: the key.
        where: the file, for messages.
        whole: match the whole name (``re.fullmatch``: a ``target_modules`` string) instead of
            PEFT's ``(.*\\.)?(key)$``.

    Raises:
        AdapterFormatError: the key is no regular expression, or one shuttle refuses.
    """
    def refuse(why: str) -> AdapterFormatError:
        return AdapterFormatError(
            f"{where}: {'target_modules' if whole else 'rank_pattern/alpha_pattern key'} "
            f"{key[:80]!r}{'...' if len(key) > 80 else ''}"
            f" {why}. shuttle matches these keys as PEFT does, in linear time: plain module "
            "names, and regular expressions without backreferences, lookarounds, atomic groups, "
            f"possessive quantifiers or inline flags, of at most {MAX_KEY_CHARS} characters. "
            "Rewrite the key, e.g. as module names joined by '|'.")

    if not set(key) & _SPECIAL and "\n" not in key:
        return PatternKey(key, True, whole, (), 0)
    if len(key) > MAX_KEY_CHARS:
        raise refuse(f"has {len(key)} characters")
    prefix = "(" if whole else _PREFIX
    # fullmatch: "$" may also match before a final newline, "\Z" only at the end
    full = f"{prefix}{key})" + ("\\Z" if whole else "$")
    try:
        re.compile(full)
    except re.error as e:
        raise refuse(f"is not a regular expression PEFT can use ({e})") from None
    except RecursionError:
        raise refuse(f"nests groups deeper than {MAX_DEPTH} levels") from None
    try:
        parser = _Parser(full)
        node = parser.alternation(0)
        builder = _Builder()
        start = builder.build(node, builder.add(("match",)))
    except _Refused as e:
        what, at = e.args
        where_in = "" if at is None else f" at index {max(at - len(prefix), 0)}"
        raise refuse(f"uses {what}{where_in}") from None
    return PatternKey(key, False, whole, tuple(builder.states), start)


def _ends_with(text: str, key: str) -> bool:
    """``(.*\\.)?(key)`` spans all of ``text``, for a key without special characters: ``.``
    matches no newline.
    """
    head = text[:len(text) - len(key)]
    return text.endswith(key) and (not head or head.endswith(".") and "\n" not in head)


# -- parsing: Python's re syntax into a tree -------------------------------------------------
#
# A node is ("char", test) | ("assert", test) | ("cat", [nodes]) | ("alt", [nodes])
# | ("repeat", node, low, high or None).


class _Parser:
    def __init__(self, text: str):
        self.text, self.i = text, 0

    def peek(self, k: int = 0) -> str:
        return self.text[self.i + k] if self.i + k < len(self.text) else ""

    def alternation(self, depth: int) -> tuple:
        if depth > MAX_DEPTH:
            raise _Refused(f"groups nested deeper than {MAX_DEPTH} levels", self.i)
        branches = [self.sequence(depth)]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.sequence(depth))
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def sequence(self, depth: int) -> tuple:
        items: list[tuple] = []
        while self.peek() not in ("", "|", ")"):
            bounds = self.quantifier()
            if bounds is None:
                atom = self.atom(depth)
                if atom is not None:
                    items.append(atom)
                continue
            if self.peek() == "+":
                raise _Refused("a possessive quantifier", self.i)
            if self.peek() == "?":  # lazy: the same set of matches
                self.i += 1
            items[-1] = ("repeat", items[-1], *bounds)  # re.compile found something to repeat
        return ("cat", items)

    def quantifier(self) -> tuple[int, int | None] | None:
        """``*``, ``+``, ``?`` or ``{m,n}`` here, consumed; None (nothing consumed) else. A
        ``{`` that does not form ``{m}``, ``{m,}``, ``{,n}`` or ``{m,n}`` is a literal, as in re.
        """
        c = self.peek()
        if c in ("*", "+", "?"):
            self.i += 1
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        if c != "{":
            return None
        m = _BRACES.match(self.text, self.i)
        if m is None or m.group(0) == "{}":
            return None
        self.i = m.end()
        low = int(m.group(1)) if m.group(1) else 0
        if m.group(2) is None:
            return low, low
        return low, int(m.group(3)) if m.group(3) else None

    def atom(self, depth: int) -> tuple | None:
        c, at = self.peek(), self.i
        if c == "(":
            return self.group(depth)
        if c == "[":
            return ("char", _char_test(self.text[at:self.class_end() + 1]))
        if c in ("^", "$"):
            self.i += 1
            return ("assert", _assertion(c))
        if c == "\\":
            return self.escape()
        self.i += 1
        if c == ".":
            return ("char", lambda ch: ch != "\n")
        return ("char", c.__eq__)

    def group(self, depth: int) -> tuple | None:
        at = self.i
        self.i += 1
        if self.peek() == "?":
            head = self.text[self.i:self.i + 3]
            if head.startswith("?:"):
                self.i += 2
            elif head.startswith("?P<"):
                self.i = self.text.index(">", self.i) + 1
            elif head.startswith("?#"):
                self.i = self.text.index(")", self.i) + 1
                return None
            else:
                what = {"?P=": "a backreference", "?=": "a lookahead", "?!": "a lookahead",
                        "?<=": "a lookbehind", "?<!": "a lookbehind", "?>": "an atomic group",
                        "?(": "a conditional group"}
                raise _Refused(next((w for k, w in what.items() if head.startswith(k)),
                                    "inline flags"), at)
        node = self.alternation(depth + 1)
        self.i += 1  # ")": re.compile found it
        return node

    def class_end(self) -> int:
        """Index of the ``]`` closing the class opened here (a ``]`` first is a member)."""
        i = self.i + 1 + (self.peek(1) == "^")
        members = 0
        while True:
            c = self.text[i]
            if c == "]" and members:
                self.i = i + 1
                return i
            i += 2 if c == "\\" else 1  # escapes' longer forms hold no "]"
            members += 1

    def escape(self) -> tuple:
        at, c = self.i, self.peek(1)
        if c in ("A", "Z", "b", "B"):
            self.i += 2
            return ("assert", _assertion(self.text[at:self.i]))
        end = at + 2
        if c in _HEX:
            end += _HEX[c]
        elif c == "N":
            end = self.text.index("}", at) + 1
        elif c == "0":
            while end < at + 4 and self.text[end:end + 1] in tuple(_OCTAL):
                end += 1
        elif c.isdigit():
            three = self.text[at + 1:at + 4]
            if len(three) < 3 or not all(d in _OCTAL for d in three):
                raise _Refused("a backreference", at)
            end = at + 4
        self.i = end
        return ("char", _char_test(self.text[at:end]))


def _char_test(atom: str) -> Callable[[str], bool]:
    """Whether one character matches ``atom`` (a class or an escape), as ``re`` says."""
    pattern = re.compile(atom)
    return lambda ch: pattern.fullmatch(ch) is not None


def _assertion(atom: str) -> Callable[[str, int], bool]:
    """Whether zero-width ``atom`` (``^``, ``$``, ``\\b``, ...) holds at a position of a name,
    as ``re`` says: ``Pattern.match(name, pos)`` keeps the name's real start and end.
    """
    pattern = re.compile(atom)
    return lambda name, pos: pattern.match(name, pos) is not None


# -- building: the tree into automaton states --------------------------------------------------


class _Builder:
    def __init__(self) -> None:
        self.states: list[_State] = []

    def add(self, state: _State) -> int:
        if len(self.states) >= MAX_STATES:
            raise _Refused(f"more than {MAX_STATES} automaton states once its counted repeats "
                           "are expanded", None)
        self.states.append(state)
        return len(self.states) - 1

    def build(self, node: tuple, after: int) -> int:
        """States for ``node`` followed by state ``after``; returns the entry state."""
        kind = node[0]
        if kind in ("char", "assert"):
            return self.add((kind, node[1], after))
        if kind == "cat":
            for item in reversed(node[1]):
                after = self.build(item, after)
            return after
        if kind == "alt":
            entries = [self.build(branch, after) for branch in node[1]]
            while len(entries) > 1:
                entries.append(self.add(("split", entries.pop(-2), entries.pop())))
            return entries[0]
        _, inner, low, high = node
        if high is None:  # inner*: a split that loops back through inner
            loop = self.add(("split", -1, after))
            body = self.build(inner, loop)
            self.states[loop] = ("split", body, after)
            tail = loop
        else:  # up to high - low optional copies, each skipping to ``after``
            tail = after
            for _ in range(high - low):
                tail = self.add(("split", self.build(inner, tail), after))
        for _ in range(low):
            tail = self.build(inner, tail)
        return tail

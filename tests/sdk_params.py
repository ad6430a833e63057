"""Request bodies built from the installed `openai` SDK's own parameter TypedDicts.

`field_cases(root, base)` walks every TypedDict reachable from `root` (through unions, lists
and mappings) and yields, for every key of each, a body that sets that key, once per literal
value where the key's type is a Literal. The body is `base` with the TypedDict placed where the
walk first found it, the required keys of everything on the way filled in. A new SDK release
that adds a field, a tool or an item type thus adds a case, which fails until the server's
schemas handle it.
"""

from __future__ import annotations

import collections.abc
import types
import typing
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Union, get_args, get_origin, get_type_hints

import typing_extensions
from typing_extensions import is_typeddict

# Keys the SDK types as any string but documents one value for ("Currently only 'compaction' is
# supported"): the server refuses the others, so a case uses that value.
DOCUMENTED = {("ContextManagement", "type"): "compaction"}

_REQUIRED = {typing.Required, typing_extensions.Required}
_NOT_REQUIRED = {typing.NotRequired, typing_extensions.NotRequired}
_LISTS = {list, typing.List, collections.abc.Iterable, collections.abc.Sequence}
_MAPS = {dict, typing.Dict, collections.abc.Mapping}


def _unwrap(t: Any) -> tuple[Any, bool]:
    """(the type inside Required/NotRequired/Annotated, whether it was Required)."""
    required = False
    while True:
        origin = get_origin(t)
        if origin in _REQUIRED:
            required, t = True, get_args(t)[0]
        elif origin in _NOT_REQUIRED or origin is typing.Annotated:
            t = get_args(t)[0]
        else:
            return t, required


def fields(td: type) -> dict[str, tuple[Any, bool]]:
    """key -> (type, required) of a TypedDict. The SDK declares requiredness with Required[...]
    inside `total=False` classes, so `__required_keys__` is read as well as the wrappers."""
    hints = get_type_hints(td, include_extras=True)
    out = {}
    for key, hint in hints.items():
        t, required = _unwrap(hint)
        out[key] = (t, required or key in getattr(td, "__required_keys__", ()))
    return out


def _alternatives(t: Any) -> list[Any]:
    origin = get_origin(t)
    if origin is Union or origin is types.UnionType:
        return [a for alt in get_args(t) for a in _alternatives(_unwrap(alt)[0])]
    return [t]


def sample(t: Any, key: str = "") -> Any:
    """One plausible value of type `t` (the first alternative of a union that is not None)."""
    t = _unwrap(t)[0]
    alts = [a for a in _alternatives(t) if a is not type(None)]
    if not alts:
        return None
    t = alts[0]
    origin = get_origin(t)
    if is_typeddict(t):
        return instance(t)
    if origin is Literal:
        return get_args(t)[0]
    if origin in _LISTS:
        return [sample(get_args(t)[0], key)]
    if origin in _MAPS:
        return {"1": sample(get_args(t)[1], key)}
    if t is bool:
        return True
    if t is int:
        return 1
    if t is float:
        return 0.5
    if t is str:
        return "x"
    if t is object:
        return {"type": "object"}  # the SDK types JSON Schemas as plain objects
    return "x"


def instance(td: type, **values: Any) -> dict[str, Any]:
    """A TypedDict with its required keys sampled, and `values` set."""
    out = {
        key: DOCUMENTED.get((td.__name__, key), sample(t, key)) for key, (t, required) in fields(td).items() if required
    }
    out.update(values)
    return out


def variants(t: Any, key: str = "") -> list[Any]:
    """The values a case tries for a key of type `t`: every literal value, one of everything else."""
    out: list[Any] = []
    for alt in _alternatives(_unwrap(t)[0]):
        if alt is type(None):
            continue
        origin = get_origin(alt)
        if origin is Literal:
            out += list(get_args(alt))
        elif origin in _LISTS and get_origin(_unwrap(get_args(alt)[0])[0]) is Literal:
            out += [[v] for v in variants(get_args(alt)[0], key)]
        else:
            value = sample(alt, key)
            if value not in out:
                out.append(value)
    return out or [None]


@dataclass
class Place:
    """Where the walk found a TypedDict: inside `parent` at `key`, wrapped as `wrap`."""

    parent: type | None
    key: str
    wrap: str  # "" | "list" | "map"


def _children(t: Any, wrap: str = "") -> Iterator[tuple[type, str]]:
    for alt in _alternatives(_unwrap(t)[0]):
        origin = get_origin(alt)
        if is_typeddict(alt):
            yield alt, wrap
        elif origin in _LISTS:
            yield from _children(get_args(alt)[0], wrap or "list")
        elif origin in _MAPS:
            yield from _children(get_args(alt)[1], wrap or "map")


def walk(root: type) -> dict[type, Place]:
    """Every TypedDict reachable from `root`, breadth first, with where it was first found."""
    places: dict[type, Place] = {root: Place(None, "", "")}
    queue = [root]
    while queue:
        td = queue.pop(0)
        for key, (t, _) in fields(td).items():
            for child, wrap in _children(t):
                if child not in places:
                    places[child] = Place(td, key, wrap)
                    queue.append(child)
    return places


@dataclass
class Case:
    owner: str  # the TypedDict, module.Name
    key: str
    value: Any
    body: dict[str, Any]
    path: str  # the key's place in the body, as OpenAI names parameters: input[0].content

    def __str__(self) -> str:
        return f"{self.owner}.{self.key}={self.value!r} at {self.path}"


def _place(places: dict[type, Place], td: type, key: str, value: Any, base: dict[str, Any]) -> tuple[dict, str]:
    """A body with `td`'s `key` set to `value`, `td` placed where the walk found it, and the
    path of that key in the body."""
    segments = [key]
    node: Any = {key: value}
    place = places[td]
    while place.parent is not None:
        node = instance(td, **node)
        inner = "[0]" if place.wrap == "list" else ".1" if place.wrap == "map" else ""
        node = {place.key: [node] if place.wrap == "list" else {"1": node} if place.wrap == "map" else node}
        segments.insert(0, place.key + inner)
        td, place = place.parent, places[place.parent]
    return {**instance(td), **base, **node}, ".".join(segments)


def field_cases(root: type, base: dict[str, Any], skip: set[str] = frozenset()) -> Iterator[Case]:
    """One case per key (per literal value) of every TypedDict reachable from `root`. `skip`:
    keys of the root whose cases the caller makes itself."""
    places = walk(root)
    for td in places:
        for key, (t, _) in fields(td).items():
            if td is root and key in skip:
                continue
            documented = DOCUMENTED.get((td.__name__, key))
            for value in [documented] if documented is not None else variants(t, key):
                body, path = _place(places, td, key, value, base)
                yield Case(f"{td.__module__.rsplit('.', 1)[-1]}.{td.__name__}", key, value, body, path)

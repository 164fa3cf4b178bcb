"""A hand-off's `HandoffMeta` as JSON, for the wire (`workers/handoff_transfer.py`).

`encode_meta` writes dataclasses as objects of their fields and tuples (NamedTuples too) as lists;
`decode_meta` rebuilds them against the dataclasses' type hints, so only ints, floats, strings,
bools, None, tuples and the dataclasses / NamedTuples the meta is made of (`HandoffEngineSpec`,
`SamplingParams`, `TokenLogprobs`, `LookupReport`) come back, each through its own constructor
and validation: nothing arbitrary is built from the network, unlike a pickle. Floats round-trip
exactly (JSON keeps `repr`), -inf and NaN included; an unknown field, a missing required one or a
value of the wrong type (a bool for an int too) raises `HandoffMetaError`.
"""

from __future__ import annotations

import types
from dataclasses import MISSING, fields, is_dataclass
from typing import Union, get_args, get_origin, get_type_hints

from workers.engine.handoff import HandoffMeta


class HandoffMetaError(ValueError):
    """The JSON is not a `HandoffMeta` (`decode_meta`)."""


def encode_meta(meta: HandoffMeta) -> object:
    """JSON-ready: dataclasses as objects of their fields, tuples (NamedTuples too) as lists."""
    if is_dataclass(meta):
        return {f.name: encode_meta(getattr(meta, f.name)) for f in fields(meta)}
    if isinstance(meta, tuple):
        return [encode_meta(v) for v in meta]
    return meta


def decode_meta(data: object) -> HandoffMeta:
    """Rebuild a `HandoffMeta` from `encode_meta`'s form, checking every value against the field
    types; raises `HandoffMetaError` naming the first field that does not fit."""
    try:
        return _decode(HandoffMeta, data, "meta")
    except (TypeError, ValueError) as exc:  # a type mismatch here, or a dataclass's own validation
        raise HandoffMetaError(f"hand-off meta does not decode: {exc}") from exc


def _decode(tp, value, where: str):
    origin = get_origin(tp)
    if tp is type(None):
        if value is None:
            return None
    elif origin in (Union, types.UnionType):
        for alt in get_args(tp):
            try:
                return _decode(alt, value, where)
            except (TypeError, ValueError):
                continue
    elif origin is tuple and isinstance(value, list):
        args = get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if len(args) == len(value):
            return tuple(_decode(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    elif is_dataclass(tp) and isinstance(value, dict):
        hints, names = get_type_hints(tp), {f.name for f in fields(tp)}
        required = {f.name for f in fields(tp) if f.default is MISSING and f.default_factory is MISSING}
        if value.keys() <= names and required <= value.keys():
            return tp(**{k: _decode(hints[k], v, f"{where}.{k}") for k, v in value.items()})
    elif isinstance(tp, type) and issubclass(tp, tuple) and hasattr(tp, "_fields") and isinstance(value, list):
        hints = get_type_hints(tp)
        if len(value) == len(tp._fields):
            return tp(*(_decode(hints[k], v, f"{where}.{k}") for k, v in zip(tp._fields, value)))
    elif tp is bool and isinstance(value, bool) or tp is str and isinstance(value, str):
        return value
    elif tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"{where}: {value!r:.80} is not a {tp}")


__all__ = ["HandoffMetaError", "decode_meta", "encode_meta"]

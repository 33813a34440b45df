"""The JSON of mpsrun's wire protocol, without importing :mod:`json` in every rank supervisor.

``json``'s import pulls in ``re`` and ``enum`` (about 9 ms, in every rank supervisor of every job).
Its parsing and encoding are done by the C accelerator ``_json``, which this module drives the way
``json`` itself does (``json.decoder.JSONDecoder`` and ``json.encoder.JSONEncoder``); where that
module is missing or its interface differs, ``json`` is used. Either way the bytes are the same
as ``json.dumps(obj, separators=(",", ":"))`` and ``json.loads`` reads them.
"""

from __future__ import annotations

TYPE_CHECKING = False  # imported by every rank supervisor: typing's import is left out
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

__all__ = ["dumps", "loads"]


def _refuse(obj: object) -> object:
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


class _Decoding:
    """The settings ``_json.make_scanner`` reads, as :class:`json.JSONDecoder` has them by default."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = float  # NaN, Infinity, -Infinity


def _accelerated() -> tuple[Callable[[str], object], Callable[[object], str]] | None:
    try:
        import _json

        scan = _json.make_scanner(_Decoding())  # type: ignore[arg-type]
        encode = _json.make_encoder(None, _refuse, _json.encode_basestring_ascii, None, ":", ",", False, False, True)
    except (ImportError, AttributeError, TypeError):
        return None

    def load(text: str) -> object:
        start = len(text) - len(text.lstrip(" \t\n\r"))
        try:
            obj, end = scan(text, start)
        except StopIteration:
            raise ValueError("not JSON") from None
        if text[end:].strip(" \t\n\r"):
            raise ValueError("extra data after the JSON value")
        return obj

    def dump(obj: object) -> str:
        return "".join(encode(obj, 0))

    return load, dump


def _standard() -> tuple[Callable[[str], object], Callable[[object], str]]:
    import json

    return json.loads, lambda obj: json.dumps(obj, separators=(",", ":"))


_load, _dump = _accelerated() or _standard()


def loads(data: bytes | str) -> Any:
    """The value of one JSON text; ValueError (or UnicodeDecodeError, a ValueError) if it is not one."""
    return _load(data.decode() if isinstance(data, bytes) else data)


def dumps(obj: object) -> str:
    """``obj`` as compact JSON, ASCII only; TypeError for what JSON cannot hold."""
    return _dump(obj)

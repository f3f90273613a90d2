"""String formats as regexes we control, exact (or narrower) with respect to the JSON Schema format checkers.

Measured with random walks through the engines' own masks (``tests/backends/test_soundness.py``): xgrammar 0.2.8
lets through ``2024-09-31``, ``12:00:60``, ``054.1.1.1`` and labels longer than 63 characters, and writes raw
quotes inside ``json-pointer`` strings; llguidance 1.9.1 lets through the leap second ``:60``; outlines-core's
``date`` takes non-ASCII digits and its ``email`` and ``uri`` raw quotes. A schema's ``format`` among these is
therefore compiled as a ``pattern`` of ours, the same on every backend. Each regex only ever produces printable
ASCII, so no backend needs to escape anything inside the string.

What each must agree with (jsonschema's checkers): ``date`` is ``date.fromisoformat`` on ``YYYY-MM-DD`` (a real
calendar day, year 1 to 9999); ``time`` and ``date-time`` are RFC 3339 as ``rfc3339-validator`` reads them after
upper-casing (no leap seconds, an offset required, ``t``/``z`` in either case); ``ipv4`` is ``ipaddress`` (no
leading zeros); ``hostname`` is ``fqdn`` (labels of 1-63 letters, digits and inner hyphens, 253 characters in
all); ``email`` needs an ``@``; ``json-pointer`` and ``relative-json-pointer`` follow RFC 6901 and its draft.
Narrowings, all deliberate: ``hostname`` has at most 4 labels of at most 62 characters (so the length bound holds
without counting); ``email`` is ``local@domain`` with common characters; JSON pointers use printable ASCII; a
relative pointer's number never has a 0 before another digit (jsonschema's checker refuses ``100``).
"""

from __future__ import annotations

_YEAR = "([1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP_YEAR = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DATE = (
    f"({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])"
    "|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
    "|02-(0[1-9]|1[0-9]|2[0-8]))"
    f"|{_LEAP_YEAR}-02-29)"
)
_TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]([.][0-9]+|)([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9][0-9]|[0-9])"
_LABEL = "[A-Za-z0-9]([A-Za-z0-9-]{0,60}[A-Za-z0-9]|)"
_POINTER_CHAR = "([ !#-.0-Z^-}]|\\[|\\]|~[01])"
_JSON_POINTER = f"(/{_POINTER_CHAR}*)*"

FORMAT_PATTERNS: dict[str, str] = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}[Tt]{_TIME}",
    "ipv4": f"{_OCTET}([.]{_OCTET}){{3}}",
    "hostname": f"{_LABEL}([.]{_LABEL}){{0,3}}([.]|)",
    "email": "[A-Za-z0-9_%+-]+([.][A-Za-z0-9_%+-]+)*@[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9]|)"
    "([.][A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9]|))*",
    "json-pointer": _JSON_POINTER,
    "relative-json-pointer": f"(0|[1-9]+(0|))(#|{_JSON_POINTER})",
}
"""Each format's regex, unanchored: a schema gets ``^(regex)$`` as its pattern. Optional parts are written
``(X|)``, never ``(X)?``: xgrammar 0.2.8 drops the first element of an optional group that holds a repetition."""


def format_pattern(format_name: str) -> str | None:
    """The anchored pattern that stands for ``format_name``, or None when the engines' own format is kept."""
    regex = FORMAT_PATTERNS.get(format_name)
    return None if regex is None else f"^({regex})$"

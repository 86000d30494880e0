"""Records: from parsed input lines to rows (id, content, typed values) or rejects with a reason.

Everything here is pure. `to_records` handles one chunk's batch: it joins product metadata with a
single lookup, renders the text that will be embedded, sanitizes every string for PostgreSQL and
coerces values to their column types. A line that cannot become a row becomes a `Reject` naming
why; it never stops the batch.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from functools import lru_cache
from string import Formatter

import orjson

from embedfleet.errors import InputError

PGTYPES = ("text", "real", "double precision", "integer", "bigint", "boolean", "timestamptz", "date", "jsonb",
           "text[]")
RAW_LIMIT = 4000  # chars of a rejected line kept for the user to inspect
_INT_RANGE = {"integer": 2**31, "bigint": 2**63}
_SURROGATES = re.compile("[\ud800-\udfff]")
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_MILLISECOND = timedelta(milliseconds=1)  # made once: epoch_millis runs for every review's id


@dataclass(frozen=True)
class Column:
    name: str
    pgtype: str  # one of PGTYPES
    words: bool = False  # text[] only: a string is a space-separated list (arXiv's categories), not one element


@dataclass
class Record:
    id: str
    content: str  # exactly the text that is embedded
    values: dict[str, object]  # column name -> coerced value (None allowed), for every preset column
    source: str
    line: int


@dataclass
class Reject:
    source: str
    line: int
    reason: str
    raw: str  # sanitized, cut to RAW_LIMIT chars


class RecordError(ValueError):
    """A line that cannot become a row; the message is the reject reason."""


class CoerceError(RecordError):
    """A value that does not fit its typed column; the message names field, value and type."""


# --- sanitizing -------------------------------------------------------------------------------


def sanitize(s: str) -> str:
    """Text PostgreSQL can store: NUL removed, lone surrogates replaced by U+FFFD."""
    if "\x00" in s:
        s = s.replace("\x00", "")
    if s.isascii():
        return s
    return _SURROGATES.sub("\ufffd", s)


def jsonable(value: object) -> object:
    """A JSON-safe copy for a jsonb column: strings (keys too) sanitized, NaN/inf -> None,
    dates as ISO text, tuples as lists, anything else Parquet may hand us as its text."""
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, str):
        return sanitize(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {sanitize(str(k)): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    if isinstance(value, Decimal):
        return jsonable(float(value))
    if isinstance(value, bytes):
        return sanitize(value.decode("utf-8", "replace"))
    return sanitize(str(value))


# --- coercion ---------------------------------------------------------------------------------


def coerce(value: object, pgtype: str, field: str) -> object:
    """`value` as the Python value for a `pgtype` column; None (and "" for non-text) stays None.

    Raises CoerceError("cannot coerce rating='five' to real") when it does not fit.
    """
    if value is None:
        return None
    if pgtype == "jsonb":
        return jsonable(value)
    if pgtype == "text":
        if isinstance(value, (dict, list)):
            raise _coerce_error(field, value, pgtype)
        if isinstance(value, (bytes, bytearray, memoryview)):  # a Parquet binary column: its text, not b'…'
            return sanitize(bytes(value).decode("utf-8", "replace"))
        return sanitize(value if isinstance(value, str) else str(value))
    if pgtype == "text[]":
        return _to_text_array(value, field)
    if isinstance(value, str):
        value = value.strip()
        if not value:
            return None
    try:
        out = _COERCE[pgtype](value)
    except (ValueError, TypeError, OverflowError, ArithmeticError):
        out = None
    if out is None:
        raise _coerce_error(field, value, pgtype)
    return out


def _coerce_error(field: str, value: object, pgtype: str) -> CoerceError:
    # An object or array as the input wrote it (JSON), not as Python prints it.
    shown = json.dumps(value, ensure_ascii=False, default=str) if isinstance(value, (dict, list)) else repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return CoerceError(f"cannot coerce {field}={shown} to {pgtype}")


def _to_float(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float, str, Decimal)):
        return None
    return float(v)


_REAL_MAX = 3.4028234663852886e38  # float4's largest finite value


def _to_real(v: object) -> float | None:
    """A float that fits float4: a finite value past its range is refused, not stored as Infinity."""
    out = _to_float(v)
    return None if out is not None and math.isfinite(out) and abs(out) > _REAL_MAX else out


def _to_decimal(v: object) -> Decimal | None:
    """Exactly as written (a float as its shortest repr); NaN and infinities are no amounts here."""
    if isinstance(v, bool) or not isinstance(v, (int, float, str, Decimal)):
        return None
    out = v if isinstance(v, Decimal) else Decimal(str(v))
    return out if out.is_finite() else None


def _to_int(v: object, bits_range: int) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, str):
        v = int(v) if v.lstrip("+-").isdigit() else float(v)
    if isinstance(v, (float, Decimal)):
        if not v == int(v):  # integral only; int(nan/inf) raises, caught by coerce
            return None
        v = int(v)
    if not isinstance(v, int) or not -bits_range <= v < bits_range:
        return None
    return v


def _to_bool(v: object) -> bool | None:
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str):
        return {"true": True, "false": False, "1": True, "0": False}.get(v.lower())
    return None


def _to_timestamp(v: object) -> datetime | None:
    """Epoch milliseconds (number or numeric string) or an ISO 8601 string; naive means UTC."""
    if isinstance(v, bool):
        return None
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            dt = datetime.fromisoformat(v)
            return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)
    if isinstance(v, datetime):
        return v if v.tzinfo else v.replace(tzinfo=timezone.utc)
    if isinstance(v, (int, float)):
        return _EPOCH + timedelta(milliseconds=v)
    return None


def _to_date(v: object) -> date | None:
    """An ISO 8601 date ("2008-11-13") or timestamp (its date); a date or datetime as is."""
    if isinstance(v, datetime):
        return v.date()
    if isinstance(v, date):
        return v
    if isinstance(v, str):
        try:
            return date.fromisoformat(v)
        except ValueError:
            return datetime.fromisoformat(v).date()
    return None


def _to_text_array(v: object, field: str, words: bool = False) -> list[str] | None:
    """A list of scalars, each as text; a string is one element, or with `words` a space-separated list (arXiv's
    "hep-ph astro-ph"); an empty one is NULL."""
    if isinstance(v, str):
        return (sanitize(v).split() if words else [sanitize(v)] if v.strip() else []) or None
    if isinstance(v, (list, tuple)):
        if any(isinstance(x, (dict, list, tuple)) for x in v):
            raise _coerce_error(field, v, "text[]")
        return [None if x is None else sanitize(x if isinstance(x, str) else str(x)) for x in v]  # null: a NULL element
    if isinstance(v, dict):
        raise _coerce_error(field, v, "text[]")
    return [sanitize(str(v))]


_COERCE: dict[str, Callable[[object], object]] = {
    "real": _to_real,
    "double precision": _to_float,
    "numeric": _to_decimal,
    "integer": lambda v: _to_int(v, _INT_RANGE["integer"]),
    "bigint": lambda v: _to_int(v, _INT_RANGE["bigint"]),
    "boolean": _to_bool,
    "timestamptz": _to_timestamp,
    "date": _to_date,
}


# Per-column coercers, `f(value, field)`, one per type, chosen once per column (`coercer`): the type
# JSON input usually holds for the column is returned as is, without `coerce`'s dispatch; every other
# value goes through `coerce`, so results and error messages are the same. Plain module functions,
# so whatever holds them still pickles.


def _text(value: object, field: str) -> object:
    if type(value) is str and value.isascii() and "\x00" not in value:  # what sanitize leaves as is
        return value
    return coerce(value, "text", field)


def _real(value: object, field: str) -> object:
    return value if type(value) is float and abs(value) <= _REAL_MAX else coerce(value, "real", field)


def _double(value: object, field: str) -> object:
    return value if type(value) is float else coerce(value, "double precision", field)


def _integer(value: object, field: str) -> object:
    if type(value) is int and -(2**31) <= value < 2**31:  # exact type: a bool is no integer here
        return value
    return coerce(value, "integer", field)


def _bigint(value: object, field: str) -> object:
    if type(value) is int and -(2**63) <= value < 2**63:
        return value
    return coerce(value, "bigint", field)


def _numeric(value: object, field: str) -> object:
    # A Decimal is a numeric already (a source table's, or a JSON number read as written): NaN and ±Infinity
    # included, as PostgreSQL's numeric holds them; only text and floats must be amounts.
    return value if type(value) is Decimal and not value.is_snan() else coerce(value, "numeric", field)


def _boolean(value: object, field: str) -> object:
    return value if type(value) is bool else coerce(value, "boolean", field)


def _timestamptz(value: object, field: str) -> object:
    if type(value) is int:  # epoch milliseconds
        try:
            return _EPOCH + timedelta(milliseconds=value)
        except OverflowError:
            pass  # out of range: coerce raises the CoerceError
    return coerce(value, "timestamptz", field)


def _date(value: object, field: str) -> object:
    return coerce(value, "date", field)


def _text_array(value: object, field: str) -> object:
    return None if value is None else _to_text_array(value, field)


def _text_array_words(value: object, field: str) -> object:
    return None if value is None else _to_text_array(value, field, words=True)


def _jsonb(value: object, field: str) -> object:
    if type(value) is list and not value:  # "images": [] on most reviews
        return []
    return jsonable(value)  # coerce's jsonb case; jsonable(None) is None


_COERCERS: dict[str, Callable[[object, str], object]] = {
    "text": _text, "real": _real, "double precision": _double, "numeric": _numeric, "integer": _integer,
    "bigint": _bigint,
    "boolean": _boolean, "timestamptz": _timestamptz, "date": _date, "jsonb": _jsonb, "text[]": _text_array,
}


def coercer(pgtype: str, words: bool = False) -> Callable[[object, str], object]:
    """`coerce` for one column type, as `f(value, field)` (same results, faster per value); `words`: Column.words."""
    return _text_array_words if words and pgtype == "text[]" else _COERCERS[pgtype]


def epoch_millis(dt: datetime) -> int:
    """The timestamp's epoch milliseconds: the canonical form used inside ids."""
    return (dt - _EPOCH) // _MILLISECOND


# --- templating -------------------------------------------------------------------------------


def validate_template(template: str) -> None:
    """Raise InputError if `template` cannot be rendered (checked once, at job start)."""
    _compile(template)


@lru_cache(maxsize=64)
def _compile(template: str) -> tuple[tuple[str, tuple[str, ...] | None], ...]:
    """(literal text, field path or None) pairs; "{{" and "}}" are literal braces."""
    parts = []
    try:
        parsed = list(Formatter().parse(template))
    except ValueError as e:
        raise InputError(f"bad text template {template!r}: {e} (write literal braces as {{{{ and }}}})") from None
    for literal, field, spec, conversion in parsed:
        if field is None:
            parts.append((literal, None))
            continue
        if not field.strip() or "[" in field or spec or conversion:
            raise InputError(
                f"bad text template {template!r}: field {{{field}}} must be a plain name or dotted path "
                "like {title} or {details.Brand} (no format specs, conversions or [index])"
            )
        parts.append((literal, tuple(field.strip().split("."))))
    return tuple(parts)


def template_fields(template: str) -> list[str]:
    """The field paths a template reads, in order, as written ("details.Brand")."""
    return [".".join(path) for _, path in _compile(template) if path is not None]


def has_field(fields: dict, path: str) -> bool:
    """Whether a record has `path` at all (its value may be null): what tells a misspelled field from a missing value."""
    if path in fields:
        return True
    value: object = fields
    for key in path.split("."):
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            return False
    return True


def lookup(fields: dict, path: tuple[str, ...] | str) -> object:
    """The value at a dotted path ("details.Brand"), or None; a key that itself has dots wins."""
    if isinstance(path, str):
        if path in fields:
            return fields[path]
        path = tuple(path.split("."))
    elif len(path) > 1 and ".".join(path) in fields:
        return fields[".".join(path)]
    value: object = fields
    for key in path:
        if isinstance(value, dict):
            value = value.get(key)
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            return None
    return value


def as_text(value: object) -> str:
    """How a field reads inside text: None -> "", a list of scalars joined by ", ", objects as JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(not isinstance(v, (dict, list)) for v in value):
        return ", ".join(as_text(v) for v in value)
    if isinstance(value, (dict, list)):
        return orjson.dumps(jsonable(value)).decode()
    return scalar_text(value)


def scalar_text(value: object) -> str:
    """A single value as text: bytes (a Parquet binary column) as the UTF-8 they hold, not `b'…'`."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


def render_template(template: str, fields: dict) -> str:
    """Fill "{title}\\n\\n{text}"-style templates. A field a record lacks (or holds null) renders as "", so
    the rest of its text is kept; a record whose whole text renders empty is a reject ("template renders
    no text"). A field no record has is refused before the job starts (`runtime.preflight`)."""
    return "".join([lit + ("" if path is None else as_text(lookup(fields, path))) for lit, path in _compile(template)])


# --- records ----------------------------------------------------------------------------------


def to_records(
    raws: Iterable,
    preset,
    *,
    template: str | None = None,
    text_field: str | None = None,
    id_field: str | None = None,
    meta_lookup: Callable[[set[str]], dict[str, dict]] | None = None,
    source_name: Callable[[str], str] = os.path.basename,
) -> tuple[list[Record], list[Reject]]:
    """One batch of RawRecords -> (records in input order, rejects). Duplicate ids are all kept.
    `source_name(source)` is how a default id names the record's file (`sources.plan.id_name`)."""
    if template is not None and text_field is not None:
        raise InputError("give a text field or a text template, not both")
    if template is None and text_field is None:
        template, text_field = preset.default_template, preset.default_text_field
    records: list[Record] = []
    rejects: list[Reject] = []
    good = []
    for raw in raws:
        if raw.error is not None:
            rejects.append(_reject(raw, raw.error))
        else:
            good.append(raw)
    products = _lookup_products(good, preset, meta_lookup)
    for raw in good:
        product = products.get(_meta_key(raw.data, preset), {}) if products else {}  # none looked up: no key to work out
        try:
            records.append(_to_record(raw, preset, product, template, text_field, id_field, source_name))
        except RecordError as e:
            rejects.append(_reject(raw, str(e)))
    return records, rejects


def _reject(raw, reason: str) -> Reject:
    return Reject(raw.source, raw.line, reason, sanitize(raw.raw[:RAW_LIMIT]))


def _meta_key(data: dict, preset) -> str | None:
    key = data.get(preset.meta_key)
    return None if key is None else str(key)


def _lookup_products(raws: list, preset, meta_lookup) -> dict[str, dict]:
    """One meta lookup for the whole batch (one round trip to the meta table, not one per line)."""
    if not preset.meta_key or meta_lookup is None:
        return {}
    keys = {k for raw in raws if (k := _meta_key(raw.data, preset)) is not None}
    return meta_lookup(keys) if keys else {}


def _to_record(raw, preset, product: dict, template: str | None, text_field: str | None, id_field: str | None,
               source_name: Callable[[str], str]) -> Record:
    data = raw.data
    if preset.exact_keys and any(type(data.get(k)) is float for k in preset.exact_keys) and raw.raw[:1] == "{":
        exact = json.loads(raw.raw, parse_float=Decimal)  # the digits as written, not the nearest float
        data = {**data, **{k: exact[k] for k in preset.exact_keys if type(data.get(k)) is float}}
    values = preset.values(data, text_field)
    for col in preset.meta_columns:
        values[col.name] = product.get(col.name)
    if text_field is not None:
        text = as_text(lookup(data, text_field))
        empty_reason = f"field '{text_field}' has no text"
    else:
        text = render_template(template, {**data, **product} if product else data)
        empty_reason = "template renders no text"
    content = preset.clean_text(sanitize(text)).strip()
    if not content:
        raise RecordError(empty_reason)
    name = source_name(raw.source)
    return Record(preset.record_id(data, values, name, raw.line, id_field), content, values, raw.source, raw.line)

"""Presets: what a kind of input becomes as a table (typed columns, id, default text, meta join).

- amazon-reviews (Amazon Reviews 2023): every review field as a typed column, unknown fields in
  `extra`, product columns joined from the meta file by parent_asin, id "user_id|asin|timestamp"
  (timestamp as epoch milliseconds, so the same review in another time format is the same row).
- generic: every field except the text in one jsonb column `record`; id from --id-field, else
  "<file>:<line>", the file named by its path below the folder all the job's inputs share (one input:
  its name), so ids match across machines and two files of one name in two folders keep their rows.
- wikipedia (Hugging Face wikimedia/wikipedia Parquet: id, url, title, text): id from `id`, columns
  url and title; the article's text lives only in `content` ("{title}\n\n{text}"), not again in a
  column of its own, since an article can be hundreds of kB (and every passage row would repeat it).
- arxiv (arxiv-metadata-oai-snapshot JSON lines): id from `id`, every snapshot field typed
  (`categories` text[] from its space-separated string, `update_date` date, `versions` and
  `authors_parsed` jsonb); content "{title}\n\n{abstract}".
- table (`--from-table`): a PostgreSQL table's rows; id from the source's key, the text from
  --text-field or --text-template, and only the --columns named copied (typed as in the source).
Every preset but generic and table keeps fields it does not know in `extra` (jsonb).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property

from embedfleet.errors import InputError
from embedfleet.sources.records import (Column, RecordError, coerce, coercer, epoch_millis, jsonable, lookup, sanitize,
                                       scalar_text)
from embedfleet.sources import plan_chunks, read_chunk

log = logging.getLogger(__name__)
_BREAKS = re.compile(r"<br\s*/?>", re.IGNORECASE)
_PRICE = re.compile(r"(?:US)?[$€£]?\s*(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?")
_WHOLE_FILE = 1 << 62  # chunk size that makes a meta file one chunk


@dataclass(frozen=True)
class Preset:
    name: str
    columns: tuple[Column, ...]  # every typed column besides id, content, embedding (incl. meta_columns)
    meta_key: str | None  # the field that joins a record to its meta row
    meta_columns: tuple[Column, ...]  # the columns filled from the meta file
    default_template: str | None
    default_text_field: str | None = None  # used when neither template nor text field is given
    fields: tuple[tuple[str, str], ...] = ()  # (input field, column) pairs with a typed column
    rest_column: str | None = None  # jsonb column that keeps every other input field
    id_fields: tuple[str, ...] = ()  # input fields joined by "|" into the id; () -> "<file>:<line>"
    id_field: str | None = None  # one input field that is the id as it stands (like --id-field)
    text_fields: tuple[str, ...] = ()  # input fields that only feed the text: no column, not in rest_column
    meta_fields: tuple[tuple[str, str], ...] = ()  # (meta field, column) pairs
    html_breaks: bool = False  # the text uses <br /> for newlines

    def values(self, data: dict, text_field: str | None = None) -> dict[str, object]:
        """Coerced typed columns of one input object (meta columns are added by the caller)."""
        get = data.get
        values = {col: to_type(get(key), key) for key, col, to_type in self._coercers}
        if self.rest_column:
            known = self._field_keys
            if data.keys() <= known:  # the usual line: no other field
                values[self.rest_column] = None
            else:
                rest = {k: v for k, v in data.items() if k not in known and k != text_field}
                values[self.rest_column] = jsonable(rest) if rest else None
        return values

    def record_id(self, data: dict, values: dict, source: str, line: int, id_field: str | None = None) -> str:
        """The deterministic row id; raises RecordError when a field it needs is missing. `source` is the
        file's name as the job's ids give it (`sources.plan.id_name`)."""
        if id_field or self.id_field:
            return _field_id(data, id_field or self.id_field)
        if not self.id_fields:
            return f"{source}:{line}"
        parts = []
        for key, col, is_time in self._id_columns:
            value = values.get(col)
            if value is None or value == "":
                raise RecordError(_no_id(key, value))
            parts.append(str(epoch_millis(value)) if is_time else str(value))
        return "|".join(parts)

    def clean_text(self, text: str) -> str:
        return _BREAKS.sub("\n", text) if self.html_breaks and "<" in text else text  # `in` is far cheaper than sub

    def meta_values(self, data: dict) -> dict[str, object]:
        """A meta object's product columns; a value that does not fit its type becomes None."""
        types = self._types
        out: dict[str, object] = {}
        for key, col in self.meta_fields:
            value = data.get(key)
            try:
                out[col] = parse_price(value) if col == "price" else coerce(value, types[col], key)
            except RecordError:
                out[col] = None
        return out

    @cached_property
    def _types(self) -> dict[str, str]:
        return {c.name: c.pgtype for c in self.columns}

    # Per-row work looks these up; they are worked out once per preset.
    @cached_property
    def _coercers(self) -> tuple[tuple[str, str, Callable[[object, str], object]], ...]:
        """(input field, column, its coercer) for every typed field."""
        words = {c.name for c in self.columns if c.words}
        return tuple((key, col, coercer(self._types[col], col in words)) for key, col in self.fields)

    @cached_property
    def exact_keys(self) -> frozenset[str]:
        """Input fields of numeric columns: a JSON number there is read as written, not through a float."""
        return frozenset(key for key, col in self.fields if self._types[col] == "numeric")

    @cached_property
    def _field_keys(self) -> frozenset[str]:
        """Input fields that rest_column leaves out: typed fields, the id field, text-only fields."""
        keys = {key for key, _ in self.fields} | set(self.text_fields)
        return frozenset(keys | {self.id_field} if self.id_field else keys)

    @cached_property
    def _id_columns(self) -> tuple[tuple[str, str, bool], ...]:
        """(input field, column, is a timestamp) for every id field."""
        columns = dict(self.fields)
        return tuple((key, columns[key], self._types[columns[key]] == "timestamptz") for key in self.id_fields)


def _no_id(field: str, value) -> str:
    """Why a record has no id: its field absent (or null), or empty."""
    return f"field '{field}' needed for the id is empty" if value == "" else f"missing field '{field}' needed for the id"


def _field_id(data: dict, id_field: str) -> str:
    value = lookup(data, id_field)
    if value is None or value == "":
        raise RecordError(_no_id(id_field, value))
    if isinstance(value, (dict, list)):
        raise RecordError(f"field '{id_field}' for the id is not a single value")
    return sanitize(scalar_text(value))


def parse_price(value: object) -> float | None:
    """A meta price: 12.99, "$12.99", "1,299.00"; None for null, "None", "—", ranges and the like."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and (m := _PRICE.fullmatch(value.strip())):
        return float(m.group(1).replace(",", "") + (m.group(2) or ""))
    return None


_REVIEW = (
    ("rating", Column("rating", "real")),
    ("title", Column("title", "text")),
    ("text", Column("text", "text")),
    ("images", Column("images", "jsonb")),
    ("asin", Column("asin", "text")),
    ("parent_asin", Column("parent_asin", "text")),
    ("user_id", Column("user_id", "text")),
    ("timestamp", Column("ts", "timestamptz")),
    ("helpful_vote", Column("helpful_vote", "integer")),
    ("verified_purchase", Column("verified_purchase", "boolean")),
)
_PRODUCT = (
    ("title", Column("product_title", "text")),
    ("main_category", Column("main_category", "text")),
    ("store", Column("store", "text")),
    ("price", Column("price", "real")),
    ("average_rating", Column("average_rating", "real")),
    ("rating_number", Column("rating_number", "integer")),
    ("features", Column("features", "jsonb")),
    ("description", Column("description", "jsonb")),
    ("categories", Column("categories", "jsonb")),
    ("details", Column("details", "jsonb")),
)

_WIKIPEDIA = (
    ("url", Column("url", "text")),
    ("title", Column("title", "text")),
)
_ARXIV = (
    ("submitter", Column("submitter", "text")),
    ("authors", Column("authors", "text")),
    ("title", Column("title", "text")),
    ("comments", Column("comments", "text")),
    ("journal-ref", Column("journal_ref", "text")),
    ("doi", Column("doi", "text")),
    ("report-no", Column("report_no", "text")),
    ("categories", Column("categories", "text[]", words=True)),
    ("license", Column("license", "text")),
    ("abstract", Column("abstract", "text")),
    ("versions", Column("versions", "jsonb")),
    ("update_date", Column("update_date", "date")),
    ("authors_parsed", Column("authors_parsed", "jsonb")),
)

PRESETS = {
    "amazon-reviews": Preset(
        name="amazon-reviews",
        columns=tuple(c for _, c in _REVIEW) + (Column("extra", "jsonb"),) + tuple(c for _, c in _PRODUCT),
        meta_key="parent_asin",
        meta_columns=tuple(c for _, c in _PRODUCT),
        default_template="{title}\n\n{text}",  # an empty title leaves just the text (content is stripped)
        fields=tuple((key, c.name) for key, c in _REVIEW),
        rest_column="extra",
        id_fields=("user_id", "asin", "timestamp"),
        meta_fields=tuple((key, c.name) for key, c in _PRODUCT),
        html_breaks=True,
    ),
    "generic": Preset(
        name="generic",
        columns=(Column("record", "jsonb"),),
        meta_key=None,
        meta_columns=(),
        default_template=None,
        default_text_field="text",
        rest_column="record",
    ),
    "table": Preset(  # --from-table: the text from --text-field or a template, --columns copied as typed columns
        name="table",
        columns=(),
        meta_key=None,
        meta_columns=(),
        default_template=None,
    ),
    "wikipedia": Preset(
        name="wikipedia",
        columns=tuple(c for _, c in _WIKIPEDIA) + (Column("extra", "jsonb"),),
        meta_key=None,
        meta_columns=(),
        default_template="{title}\n\n{text}",
        fields=tuple((key, c.name) for key, c in _WIKIPEDIA),
        rest_column="extra",
        id_field="id",
        text_fields=("text",),
    ),
    "arxiv": Preset(
        name="arxiv",
        columns=tuple(c for _, c in _ARXIV) + (Column("extra", "jsonb"),),
        meta_key=None,
        meta_columns=(),
        default_template="{title}\n\n{abstract}",
        fields=tuple((key, c.name) for key, c in _ARXIV),
        rest_column="extra",
        id_field="id",
    ),
}


FILE_PRESETS = tuple(p for p in PRESETS if p != "table")  # "table" is --from-table's own

# Columns embedfleet may add to a table later, not to be taken by a promoted field.
RESERVED = {"content_tsv": "the full-text column (--fts, index --fts)", "map_x": "map --store-coords' column",
            "map_y": "map --store-coords' column"}

# `--columns NAME:TYPE,…`: the types a promoted field may take, by the names a user would write.
COLUMN_TYPES = {
    "int": "bigint", "integer": "integer", "bigint": "bigint", "real": "real", "float": "double precision",
    "double": "double precision", "numeric": "numeric", "decimal": "numeric", "text": "text", "bool": "boolean",
    "boolean": "boolean", "date": "date",
    "timestamp": "timestamptz", "timestamptz": "timestamptz", "json": "jsonb", "jsonb": "jsonb", "text[]": "text[]",
}
def _column_name(name: str) -> bool:
    """A name a column can have: PostgreSQL's 63 bytes at most, no control character (quoted in SQL, any other)."""
    return 0 < len(name.encode()) <= 63 and name.isprintable()


def parse_columns(specs: list[str] | None) -> tuple[Column, ...]:
    """`--columns stars:int,lang:text`: each NAME (a field of the records, and the column's name) with its type."""
    out: list[Column] = []
    for spec in specs or []:
        name, colon, kind = spec.strip().partition(":")
        name, kind = name.strip(), kind.strip().lower()
        if not colon or not _column_name(name) or kind not in COLUMN_TYPES:
            raise InputError(f"--columns {spec!r}: give NAME:TYPE, NAME a field of the records (at most 63 bytes) "
                             f"and TYPE one of {', '.join(COLUMN_TYPES)}")
        if name in {c.name for c in out}:
            raise InputError(f"--columns: {name!r} is given twice")
        out.append(Column(name, COLUMN_TYPES[kind]))
    return tuple(out)


def job_preset(name: str, columns: list[str] | None = None) -> Preset:
    """The preset a job uses: `name`'s, with the `--columns` fields promoted from the records (out of the
    preset's catch-all jsonb column) into typed columns of their own."""
    preset = get_preset(name)
    extra = parse_columns(columns)
    if not extra:
        return preset
    from embedfleet.encode.passages import COLUMNS as PASSAGE_COLUMNS

    taken = {"id", "content", "embedding", *(c.name for c in preset.columns), *(c.name for c in PASSAGE_COLUMNS)}
    clash = [c.name for c in extra if c.name in taken]
    if clash:
        whose = f"preset {name}" if clash[0] in {c.name for c in preset.columns} else \
            "the table embedfleet writes (id, content, embedding; parent_id, passage with --passages)"
        raise InputError(f"--columns {clash[0]!r}: {whose} already has a column of that name")
    kept = [c.name for c in extra if c.name in RESERVED]
    if kept:
        raise InputError(f"--columns {kept[0]!r}: the name of {RESERVED[kept[0]]}; promote the field under another "
                         "name")
    return dataclasses.replace(preset, columns=preset.columns + extra,
                               fields=preset.fields + tuple((c.name, c.name) for c in extra))


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise InputError(f"unknown preset {name!r}; choose one of: {', '.join(FILE_PRESETS)}") from None


def load_meta(path: str, preset: Preset, on_skip: Callable[[int, str], None] | None = None) -> Iterator[tuple[str, dict]]:
    """Stream (key, {meta column: value}) from a meta file of any supported input kind.

    Meta lines are never rejects: a malformed line or one without the key is skipped, reported to
    `on_skip(line, reason)` and counted in one warning at the end. Repeated keys are all yielded.
    """
    if not preset.meta_key:
        raise InputError(f"preset '{preset.name}' does not join a meta file")
    skipped, first = 0, None
    for spec in plan_chunks([path], _WHOLE_FILE):
        for raw in read_chunk(spec):
            key = None if raw.data is None else raw.data.get(preset.meta_key)
            if key is None or key == "":
                reason = raw.error or f"missing field '{preset.meta_key}'"
                skipped += 1
                first = first or (raw.line, reason)
                if on_skip:
                    on_skip(raw.line, reason)
                continue
            yield sanitize(str(key)), preset.meta_values(raw.data)
    if skipped:
        log.warning("meta file %s: skipped %d lines (first: line %d, %s)", path, skipped, *first)


def table_columns(preset: str, passages: bool = False, columns: list[str] | None = None) -> tuple[Column, ...]:
    """A job's table columns besides id, content and embedding: the preset's and its --columns, and with
    --passages the record each passage came from and its place in it."""
    from embedfleet.encode.passages import COLUMNS

    return job_preset(preset, columns).columns + (COLUMNS if passages else ())

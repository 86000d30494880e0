"""Checks on a job's inputs before it is planned: a job that cannot produce a row should stop with one
line that says why, not embed nothing for a while and exit 0."""

from __future__ import annotations

import itertools
import os

from embedfleet.settings import JobSpec
from embedfleet.errors import InputError
from embedfleet.sources.records import has_field, template_fields, to_records
from embedfleet.sources import ChunkSpec, input_kind, read_chunk
from embedfleet.sources.files import is_url, size
from embedfleet.sources.presets import job_preset

SAMPLE = 200  # records read from the first input
_HEAD_BYTES = 1 << 20  # of a plain JSONL file: enough for the sample


def first_records(path: str, n: int = SAMPLE) -> list:
    """Up to `n` records from the start of `path`, without planning the whole file."""
    kind = input_kind(path)
    if kind == "jsonl":
        spec = ChunkSpec(path, kind, 0, min(size(path), _HEAD_BYTES), 1)
    elif kind == "parquet":
        spec = ChunkSpec(path, kind, 0, 1, 1)
    else:
        spec = ChunkSpec(path, kind, 0, -1, 1)
    return list(itertools.islice(read_chunk(spec), n))


def _shown(fields: list[str]) -> str:
    return ", ".join(fields[:30]) + (", …" if len(fields) > 30 else "")


def check_not_a_json_array(path: str) -> None:
    """A .json file holding one JSON array (pretty-printed, its first line "["): every line of it would be a
    malformed record. One line saying how to make JSON Lines of it instead."""
    if not path.lower().endswith(".json") or is_url(path):
        return
    try:
        with open(path, "rb") as f:
            head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    except OSError:  # the planner says what is wrong with it
        return
    if head.startswith(b"["):
        name = os.path.basename(path)
        raise InputError(f"{name} holds one JSON array; embedfleet reads JSON Lines, one object a line: convert it "
                         f"with `jq -c '.[]' {name} > {name}l` and ingest that")


_OTHER_SEPARATORS = (";", "\t", "|")


def check_comma_separated(path: str) -> None:
    """A CSV file whose header is one field holding another separator (`;`, a tab, `|`): every record would be
    rejected or read as one field. One line naming the separator it seems to use."""
    from embedfleet.sources.base import open_binary

    try:
        with open_binary(path) as f:
            header = f.readline(65536).decode("utf-8", "replace").lstrip("\ufeff").rstrip("\r\n")
    except Exception:  # an unreadable file is the planner's and the workers' to report
        return
    if "," in header or '"' in header:
        return
    for sep in _OTHER_SEPARATORS:
        if sep in header:
            shown, flag = ("a tab", "-t") if sep == "\t" else (repr(sep), f"-d '{sep}'")
            name = os.path.basename(path)
            raise InputError(f"{name}: its header is one column ({header[:80]!r}), with {shown} between names; "
                             f"embedfleet reads comma-separated CSV: convert it first (csvkit: `csvformat {flag} "
                             f"{name} > {os.path.splitext(name)[0]}-commas.csv`)")


def check_inputs_have_text(cfg: JobSpec) -> None:
    """Stop now, naming the fields the records have, if the first input's first records show the job cannot
    work: a template field none of them has (a misspelling would render empty in every record), or every
    record rejected for one and the same reason (a text or id field the file does not have)."""
    for source in cfg.inputs:
        check_not_a_json_array(source)
        if input_kind(source) == "csv":
            check_comma_separated(source)
    path = cfg.inputs[0]
    try:
        raws = [r for r in first_records(path) if r.error is None]
    except Exception:  # an unreadable file is the planner's and the workers' to report
        return
    if not raws:
        return
    preset = job_preset(cfg.preset, cfg.columns)
    fields = sorted({k for r in raws for k in r.data})
    joined = {c.name for c in preset.meta_columns} if cfg.meta else set()  # product fields come with --meta
    if cfg.text_template:  # (a product field's own keys are known only once the meta file is joined)
        missing = [f for f in template_fields(cfg.text_template)
                   if f.split(".")[0] not in joined and not any(has_field(r.data, f) for r in raws)]
        if missing:
            raise InputError(f"--text-template field {{{missing[0]}}}: none of the first {len(raws)} records of "
                             f"{os.path.basename(path)} has it; the records have fields: {_shown(fields)}"
                             + (f"; the products have: {_shown(sorted(joined))}" if joined else ""))
    # a field named on the command line that no record has (other faults may hide it among the rejects)
    for flag, field in (("--id-field", cfg.id_field), ("--text-field", None if cfg.text_template else cfg.text_field)):
        if field and field not in joined and not any(has_field(r.data, field) for r in raws):
            raise InputError(f"{flag} {field!r}: none of the first {len(raws)} records of {os.path.basename(path)} "
                             f"has it; the records have fields: {_shown(fields)}")
    if cfg.meta:  # the text may come from the products, joined later: the rejects here say nothing yet
        return
    records, rejects = to_records(raws, preset, template=cfg.text_template,
                                  text_field=cfg.text_field, id_field=cfg.id_field)
    reasons = {r.reason for r in rejects}
    if records or len(reasons) != 1:
        return
    shown = _shown(fields)
    hint = "pass --text-field FIELD or --text-template" if "text" in next(iter(reasons)) else "pass --id-field FIELD"
    raise InputError(f"{os.path.basename(path)}: all of the first {len(raws)} records are rejected "
                     f"({next(iter(reasons))}); the records have fields: {shown}; {hint}")

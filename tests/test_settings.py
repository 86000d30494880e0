"""Settings and specs: flags over YAML, types checked, every knob declared once and in the reference."""

from __future__ import annotations

import pytest

from embedfleet.errors import InputError
from embedfleet.settings import JobSpec, build_job
from embedfleet.sources.plan import ChunkSpec


def _c(src, first, kind="jsonl"):
    return ChunkSpec(src, kind, 0, 0, first)


def test_config_flags_win_over_yaml_and_identity_ignores_runtime_knobs(tmp_path):
    y = tmp_path / "job.yaml"
    y.write_text("inputs: [a.jsonl]\nmodel: m1\nworkers: 4\nchunk-bytes: 4096\n")
    cfg = build_job({"model": "m2", "inputs": None}, str(y))
    assert (cfg.inputs, cfg.model, cfg.workers, cfg.chunk_bytes) == (("a.jsonl",), "m2", 4, 4096)
    assert cfg.preset == "generic"
    other = JobSpec(**{**cfg.__dict__, "workers": 1, "devices": "cpu", "quiet": True})
    assert other.fingerprint() == cfg.fingerprint()
    assert JobSpec(**{**cfg.__dict__, "model": "m3"}).fingerprint() != cfg.fingerprint()


@pytest.mark.parametrize("flags, msg", [
    ({"devices": "gpu"}, "--devices"),
    ({"batch_tokens": "lots"}, "--batch-tokens"),
    ({"dtype": "int8"}, "--dtype"),
    ({"preset": "nope"}, "--preset"),
    ({"meta": "m.jsonl", "preset": "generic"}, "--meta"),
    ({"text_field": "a", "text_template": "{b}"}, "not both"),
    ({"limit": 0}, r"--limit 0: embed at least 1 record"),  # it blamed the inputs: "hold no records"
    ({"no_index": True, "index": "binary"}, r"--index binary asks for an index and --no-index for none"),
])
def test_bad_flags_are_refused_with_the_flag_named(flags, msg):
    with pytest.raises(InputError, match=msg):
        build_job({"inputs": ["a.jsonl"], **flags})


def test_yaml_with_unknown_key_is_refused(tmp_path):
    y = tmp_path / "job.yaml"
    y.write_text("inputs: [a]\nmodle: x\n")
    with pytest.raises(InputError, match="unknown key 'modle'"):
        build_job({}, str(y))


@pytest.mark.parametrize("line, key, expected", [
    ('limit: "five"', "limit", "expected int | null, got str"),
    ("table: [a, b]", "table", "expected str | null, got array"),
    ("limit: 3.7", "limit", "expected int | null, got float"),
    ('no_index: "false"', "no_index", "expected bool, got str"),
    ("no-index: 1", "no_index", "expected bool, got int"),
    ("workers: [2]", "workers", "expected int | null, got array"),
])
def test_yaml_values_of_the_wrong_type_are_refused_naming_the_key(tmp_path, line, key, expected):
    y = tmp_path / "job.yaml"
    y.write_text(f"inputs: [a.jsonl]\n{line}\n")
    with pytest.raises(InputError) as err:
        build_job({}, str(y))
    assert str(err.value) == f"{y}: key '{key}' (--{key.replace('_', '-')}): {expected}"


def test_yaml_values_of_the_right_type_pass(tmp_path):
    y = tmp_path / "job.yaml"
    y.write_text("inputs: a.jsonl\nlimit: 5\nno_index: true\nbatch-tokens: 4096\ntable: t\n")
    cfg = build_job({}, str(y))
    assert (cfg.inputs, cfg.limit, cfg.no_index, cfg.batch_tokens, cfg.table) == (("a.jsonl",), 5, True, 4096, "t")


def test_every_knob_is_read_once_and_listed_in_the_configuration_reference():
    import dataclasses
    from pathlib import Path

    from embedfleet.settings import Settings

    reference = (Path(__file__).resolve().parents[1] / "docs" / "reference" / "configuration.md").read_text()
    for f in dataclasses.fields(Settings):
        assert f"| `{f.metadata['env']}` |" in reference, f"the configuration reference lacks {f.metadata['env']}"
    s = Settings.from_env({"EMBEDFLEET_LEASE_SECONDS": "3", "EMBEDFLEET_COMPILE": "0", "EMBEDFLEET_WRITERS": "2"},
                          writers=5)
    assert (s.lease_seconds, s.compile, s.writers) == (3.0, False, 5)  # a flag wins over the variable
    assert Settings.from_json(s.to_json()) == s  # what a launcher hands its workers comes back whole
    for env, bad in (("EMBEDFLEET_WRITERS", "two"), ("EMBEDFLEET_LEASE_SECONDS", "-1"), ("EMBEDFLEET_COMPILE", "maybe"),
                     ("EMBEDFLEET_HELPER_NICE", "20"), ("EMBEDFLEET_HELPER_NICE", "-1")):
        with pytest.raises(InputError, match=env):
            Settings.from_env({env: bad})


def test_a_config_file_takes_the_flags_spellings_reads_paths_beside_it_and_gives_way_to_flags(tmp_path, monkeypatch):
    """Keys spelled as the flags (`from-table`, `replace`, `source-db`, `metrics-port`, `ray`, `json`); a relative
    input or model found in the file's folder, whatever the current one; a template's backslash-n a newline, as on
    the command line; a flag that picks the other of two ways (--text-template, --from-table) wins."""
    from embedfleet.settings import run_options

    conf = tmp_path / "conf"
    (conf / "data").mkdir(parents=True)
    (conf / "data" / "items.jsonl").write_text('{"text": "x"}\n')
    (conf / "model").mkdir()
    y = conf / "job.yaml"
    y.write_text("inputs: data/items.jsonl\nmodel: model\ntext_field: body\nreplace: [data/items.jsonl]\n"
                 "source-db: postgresql://src/db\nmetrics-port: 9109\nray: auto\njson: true\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = build_job({}, str(y))
    assert cfg.inputs == (str(conf / "data" / "items.jsonl"),) and cfg.model == str(conf / "model")
    assert cfg.replacing == ("data/items.jsonl",) and cfg.text_field == "body"
    assert run_options(str(y)) == run_options(str(y)).__class__(source_db="postgresql://src/db", metrics_port=9109,
                                                                  ray="auto", json=True)
    assert build_job({"text_template": "{title}"}, str(y)).text_field is None  # the flag's way, not the file's
    (conf / "f.yaml").write_text("inputs: data/items.jsonl\ntext_field: body\n")
    assert build_job({"source_table": "items"}, str(conf / "f.yaml")).inputs == ("items",)
    (conf / "t.yaml").write_text("inputs: data/items.jsonl\ntext_template: '{title}\\n\\n{body}'\n")
    assert build_job({}, str(conf / "t.yaml")).text_template == "{title}\n\n{body}"
    (conf / "bad.yaml").write_text("inputs: data/items.jsonl\nfrom-table: [a]\n")
    with pytest.raises(InputError, match=r"key 'source_table' \(--from-table\)"):
        build_job({}, str(conf / "bad.yaml"))


def test_a_relative_model_folder_is_recorded_whole(tmp_path, monkeypatch):
    """A job's model is read by workers and searches run from other folders: a relative folder is made absolute;
    a hub id stays as given."""
    (tmp_path / "models" / "mine").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert build_job({"inputs": ["a.jsonl"], "model": "models/mine"}).model == str(tmp_path / "models" / "mine")
    assert build_job({"inputs": ["a.jsonl"], "model": "org/some-model"}).model == "org/some-model"

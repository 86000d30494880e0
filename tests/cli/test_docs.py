"""The documentation holds to the code: the reference pages are what the code's own declarations render, every
```python block of README.md and docs/ runs as written on the README's CPU path (after its first ingest, in a
fresh process, on a home of its own), the site builds strictly, and bench/README.md names every file in bench/."""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys

import pytest
from conftest import EXAMPLES, ROOT

DOCS = ROOT / "docs"
FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


def _python_blocks() -> list[tuple[str, int, str]]:
    out = []
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        if "archive" in page.parts:
            continue
        text = page.read_text()
        for m in FENCE.finditer(text):
            out.append((str(page.relative_to(ROOT)), text[: m.start()].count("\n") + 1, m.group(1)))
    return out


def test_the_reference_pages_are_what_the_code_renders():
    generate = runpy.run_path(str(DOCS / "generate.py"))
    for key, text in generate["render"]().items():
        assert generate["PAGES"][key].read_text() == text, f"run `python docs/generate.py`: {key} is stale"


def test_bench_readme_names_every_file_in_bench():
    readme = (ROOT / "bench" / "README.md").read_text()
    missing = [p.name for p in (ROOT / "bench").iterdir() if p.name != "__pycache__" and f"`{p.name}`" not in readme]
    assert missing == []


@pytest.fixture(scope="module")
def readme_home(tmp_path_factory):
    """A home where the README's first command has run (its embedded server stopped at the end)."""
    home = tmp_path_factory.mktemp("docs-home")
    env = dict(os.environ, EMBEDFLEET_HOME=str(home))
    env.pop("EMBEDFLEET_DB", None)
    ingest = [sys.executable, "-m", "embedfleet.cli", "ingest", str(EXAMPLES / "Cell_Phones_and_Accessories.jsonl"),
              "--meta", str(EXAMPLES / "meta_Cell_Phones_and_Accessories.jsonl"), "--preset", "amazon-reviews",
              "--devices", "cpu", "--quiet"]
    p = subprocess.run(ingest, env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr[-3000:]
    yield env
    subprocess.run([sys.executable, "-m", "embedfleet.cli", "db", "stop"], env=env, capture_output=True, timeout=120)


BLOCKS = _python_blocks()


def test_the_docs_have_python_to_run():
    pages = {page for page, _, _ in BLOCKS}
    assert "README.md" in pages and len(BLOCKS) >= 3


@pytest.mark.parametrize("page,line,code", BLOCKS, ids=[f"{p}:{n}" for p, n, _ in BLOCKS])
def test_a_python_block_runs_as_written(readme_home, tmp_path, page, line, code):
    p = subprocess.run([sys.executable, "-c", code], env=readme_home, cwd=tmp_path, capture_output=True, text=True,
                       timeout=600, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, f"{page}:{line}\n{p.stderr[-3000:]}"


def test_the_site_builds_strictly(tmp_path):
    p = subprocess.run(["mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]

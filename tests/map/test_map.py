"""`embedfleet map`: the real CLI on a real table, the page opened in headless Chromium."""

from __future__ import annotations

import io
import os
import shutil
import time

import numpy as np
import orjson
import pytest

from embedfleet.synth_table import write_vector_table

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
# umap-learn's numba functions compile in every new process (~25 s on the 2-core VM); a cache keeps
# what numba can keep for the next run.
NUMBA_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "embedfleet-numba")


def _browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1200,900"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)


def _pixels(png: bytes) -> np.ndarray:
    from PIL import Image  # matplotlib's own dependency

    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def _hover(driver, x: float, y: float) -> None:
    from selenium.webdriver.common.actions.action_builder import ActionBuilder

    action = ActionBuilder(driver)
    action.pointer_action.move_to_location(int(round(x)), int(round(y)))  # viewport pixels
    action.perform()


@pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER), reason="needs Debian's chromium and chromium-driver (.ci/run installs them)")
def test_map_page_in_headless_chromium(cli, dsn, conn, tmp_path):
    write_vector_table(conn, "docs", 2500, topics=6, seed=5)
    html, png = tmp_path / "map.html", tmp_path / "map.png"
    p = cli("map", "--table", "docs", "--color-by", "topic", "--sample", 2000, "--out", html, "--out", png,
            "--store-coords", "--db", dsn, "--json", check=True, extra_env={"NUMBA_CACHE_DIR": NUMBA_CACHE})
    summary = orjson.loads(p.stdout)
    assert (summary["rows"], summary["total"], summary["stored"]) == (2000, 2500, ["map_x", "map_y"])
    assert summary["layout_s"] == summary["umap_s"] > 0 and summary["method"]  # one time, whichever layout ran
    mapped = dict(conn.execute("SELECT id, content FROM docs WHERE map_x IS NOT NULL AND map_y IS NOT NULL").fetchall())
    assert len(mapped) == 2000 and conn.execute("SELECT count(*) FROM docs WHERE map_x IS NULL").fetchone()[0] == 500
    topic = dict(conn.execute("SELECT id, topic FROM docs").fetchall())

    page = html.read_bytes()
    assert b"://" not in page and b"<script src" not in page and b"<link" not in page  # nothing to fetch
    assert b"2,000 of 2,500 rows, a random sample" in page  # says it is a sample
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and _pixels(png.read_bytes()).std() > 5

    driver = _browser()
    try:
        driver.get(html.as_uri())
        state = driver.execute_script("const m = window.embedfleetMap; "
                                      "return [m.n, m.drawn, Array.from({length: m.n}, (_, i) => m.id(i)), "
                                      "Array.from({length: m.n}, (_, i) => m.screen(i))]")
        n, drawn, ids, screen = state
        assert n == drawn == 2000 and set(ids) == set(mapped)  # one point per sampled row, all of them drawn
        shot = _pixels(driver.get_screenshot_as_png())
        colours = {tuple(c) for c in shot.reshape(-1, 3)[:: 7]}
        assert (shot < 200).any(axis=2).mean() > 0.002 and len(colours) > 6  # points in several colours

        # hover the point farthest from any other: its own row's text shows
        xy = np.array(screen)
        d = ((xy[:, None, :] - xy[None, :, :]) ** 2).sum(-1)
        np.fill_diagonal(d, np.inf)
        i = int(d.min(axis=1).argmax())
        _hover(driver, *xy[i])
        time.sleep(0.2)
        assert driver.execute_script("return window.embedfleetMap.hovered") == i
        tip = driver.find_element("id", "tooltip").text
        assert f"id: {ids[i]}" in tip and mapped[ids[i]][:300] in tip and f"topic: {topic[ids[i]]}" in tip

        # the legend toggles a colour: its points go, then come back
        item = driver.find_elements("css selector", "#legend .item")[0]
        label = item.find_element("css selector", ".label").text
        hidden = sum(1 for rid in ids if topic[rid] == label)
        item.click()
        time.sleep(0.5)
        assert driver.execute_script("return window.embedfleetMap.drawn") == 2000 - hidden and hidden > 0
        item.click()
        time.sleep(0.5)
        assert driver.execute_script("return window.embedfleetMap.drawn") == 2000
    finally:
        driver.quit()


def test_map_without_its_extra_says_what_to_install(cli, dsn, tmp_path):
    fake = tmp_path / "no-umap" / "umap"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named umap')\n")
    path = os.pathsep.join([str(fake.parent), os.environ.get("PYTHONPATH", "")])
    p = cli("map", "--table", "t", "--out", tmp_path / "m.html", "--db", dsn, extra_env={"PYTHONPATH": path})
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1] == "error: embedfleet map needs umap-learn: pip install 'embedfleet[map]'"


def test_an_empty_table_is_refused_with_one_line(cli, dsn, conn, tmp_path):
    conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
    conn.execute("CREATE TABLE empty (id text PRIMARY KEY, content text, embedding vector(8))")
    p = cli("map", "--table", "empty", "--out", tmp_path / "m.png", "--db", dsn)
    assert p.returncode == 2 and "Traceback" not in p.stderr and not (tmp_path / "m.png").exists()
    assert p.stderr.strip().splitlines()[-1] == "error: table 'empty' has no rows to map (it is empty)"


def test_a_numeric_column_colours_by_number_bins_not_by_each_value(conn):
    from embedfleet.map import read_sample

    conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
    conn.execute("CREATE TABLE priced (id text PRIMARY KEY, content text, embedding vector(3), price numeric(10,2))")
    conn.execute("INSERT INTO priced SELECT 'p' || g, 'item ' || g, ARRAY[g, 1, 0]::float4[]::vector, g * 1.25 "
                 "FROM generate_series(1, 60) g")
    data = read_sample(conn, "priced", 100, "price")
    assert sorted(data.color) == [g * 1.25 for g in range(1, 61)]  # numbers, as a double column's are


def test_store_coords_never_writes_over_a_column_of_the_users_own(cli, dsn, conn, tmp_path):
    """A table whose own `map_x` holds the user's text: --store-coords refuses before laying anything out, and the
    column keeps its values (they became coordinates, the column still text)."""
    write_vector_table(conn, "own_xy", 40, dim=8)
    conn.execute("ALTER TABLE own_xy ADD COLUMN map_x text")
    conn.execute("UPDATE own_xy SET map_x = 'left'")
    p = cli("map", "--table", "own_xy", "--out", tmp_path / "m.png", "--store-coords", "--db", dsn)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "has a column 'map_x' of its own" in p.stderr.strip().splitlines()[-1]
    assert conn.execute("SELECT count(*) FROM own_xy WHERE map_x = 'left'").fetchone()[0] == 40
    assert not (tmp_path / "m.png").exists()


def test_a_small_sample_of_a_larger_table_has_as_many_rows_as_asked(conn):
    """A sample of N rows is N rows, for any seed (a Bernoulli sample 2% over N gave one row for 10 of 600)."""
    from embedfleet.map import read_sample

    write_vector_table(conn, "many", 600, dim=8)
    for sample in (1, 2, 10, 50):
        assert {len(read_sample(conn, "many", sample, None, seed).ids) for seed in range(8)} == {sample}

"""`bench`, `db`, `cache`: the encoder's benchmark, the embedded server, the compile cache."""

from __future__ import annotations

from typing import List, Optional

import typer

from embedfleet.cli.app import TrustOpt, app, cache_app, db_app, emit, knobs
from embedfleet.errors import EmbedfleetError


@db_app.command("uri")
def db_uri() -> None:
    """Print the embedded server's DSN (starting it if needed)."""
    from embedfleet.pg.embedded import start

    typer.echo(start(knobs()))


@db_app.command("start")
def db_start() -> None:
    """Start the embedded server."""
    from embedfleet.pg.embedded import start

    typer.echo(f"running: {start(knobs())}", err=True)


@db_app.command("stop")
def db_stop() -> None:
    """Stop the embedded server."""
    from embedfleet.pg.embedded import stop

    typer.echo("stopped" if stop(knobs()) else "not running", err=True)


@cache_app.command("path")
def cache_path(json_out: bool = typer.Option(False, "--json", help='{"path": …}')) -> None:
    """Print where compiled graphs and kernels are kept ($EMBEDFLEET_HOME/cache)."""
    from embedfleet.platform.cache import cache_dir

    if json_out:
        emit({"path": str(cache_dir(knobs().home_path))})
    else:
        typer.echo(str(cache_dir(knobs().home_path)))


@cache_app.command("clear")
def cache_clear(json_out: bool = typer.Option(False, "--json")) -> None:
    """Remove the cache of compiled graphs, kernels and bytecode (the next big encode compiles again)."""
    from embedfleet.platform.cache import cache_dir, clear

    removed = clear(cache_dir(knobs().home_path))
    if json_out:
        emit(removed)
    else:
        typer.echo(f"removed {removed['path']}: {removed['files']} files, {removed['bytes'] / 1e6:.1f} MB", err=True)


@app.command()
def bench(
    shape: List[str] = typer.Option(None, "--shape", help="minilm-l6 | bert-base | modernbert-base | modernbert-large | gemma3-300m | nomic-embed-v1.5 | qwen3-0.6b (repeatable)"),
    model: Optional[str] = typer.Option(None, "--model", help="a real model directory instead of a shape"),
    n: Optional[int] = typer.Option(None, "--n", help="texts per run (default 20000 on a GPU, 1000 on a CPU)"),
    texts: List[str] = typer.Option(None, "--texts", help="reviews | world (repeatable; default both)"),
    device: str = typer.Option("auto", "--device"),
    no_st: bool = typer.Option(False, "--no-st", help="skip the sentence-transformers baseline"),
    batch_tokens: str = typer.Option("auto", "--batch-tokens"),
    trust_remote_code: bool = TrustOpt,
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """This encoder against sentence-transformers on the same texts, each measurement a fresh process.

    Each tool at its best on the device (a GPU: bf16, sentence-transformers at batch 256; a CPU: the dtype it
    is fastest in, sentence-transformers at its default batch 32). Measured: the first call (constructor
    included, also from a script importing torch and sentence-transformers), the steady state, one query."""
    from embedfleet.encode.bench import TEXT_SETS, format_bench, run_bench

    bad = [t for t in texts or [] if t not in TEXT_SETS]
    if bad:
        raise EmbedfleetError(f"--texts {bad[0]!r}: choose from {', '.join(TEXT_SETS)}")
    result = run_bench(shape or None, model, n=n, device=device, st=not no_st, batch_tokens=batch_tokens,
                       text_sets=texts or None, trust_remote_code=trust_remote_code)
    if json_out:
        emit(result)
    else:
        typer.echo(format_bench(result))

"""The command line. Thin: each command parses flags, resolves the settings once (`app.knobs`) and calls one function.

    ingest   inputs → embeddings → PostgreSQL, on every local device   (ingest/job.py → ingest/launch → ingest/worker.py)
    worker   join a running job from any host                           (ingest/launch/local.py)
    status   the ledger's view of every job, and the fleet working on them
    jobs rm  a job's ledger entries removed
    search   nearest neighbours of a query text (or a file of them)     (query/search.py)
    serve    the same over HTTP, the model loaded once                   (query/serve.py)
    verify   row counts, overwrites, dimensions, norms                    (query/verify.py)
    train    a head on a table's stored vectors, on every local device  (train/trainer.py)
    predict  a trained head applied to a table's stored vectors          (train/predict.py)
    export   a table's ids, columns and vectors to Parquet, .npy or JSON lines (export.py)
    map      a 2-D map of a table's vectors, as one self-contained HTML page or a PNG (map/)
    bench    this encoder vs sentence-transformers, first call and steady state, fresh processes
    db       the embedded PostgreSQL
    cache    compiled graphs, kernels and bytecode kept between processes

With --json, stdout carries exactly one JSON document; logs and progress go to stderr.
Errors a user can act on print one line and exit non-zero (no traceback unless --debug).
"""

from embedfleet.cli import admin, ingest, query, tables, train  # noqa: F401 - each registers its commands
from embedfleet.cli.app import app, cache_app, db_app, jobs_app, main

app.add_typer(db_app, name="db")
app.add_typer(jobs_app, name="jobs")
app.add_typer(cache_app, name="cache")

__all__ = ["app", "cache_app", "db_app", "jobs_app", "main"]

if __name__ == "__main__":
    main()

"""`train` and `predict`: heads on a table's stored vectors."""

from __future__ import annotations

from typing import Optional

import orjson
import typer

from embedfleet.cli.app import DbOpt, app, check_where, emit, knobs
from embedfleet.logs import plural


@app.command()
def train(
    table: str = typer.Option(..., "--table", help="a table `embedfleet ingest` wrote, or any table"),
    label: str = typer.Option(..., "--label", help="the column to predict"),
    features: Optional[str] = typer.Option(None, "--features", help="columns making the input, comma-separated: "
                                           "numbers, booleans, fixed-length arrays, vectors, bytea of float32 "
                                           "(default: the table's vector column)"),
    fill_null: Optional[float] = typer.Option(None, "--fill-null", help="the value standing in for a feature's "
                                              "NULL (default: a NULL is refused)"),
    task: str = typer.Option(..., "--task", help="classify | regress"),
    head: str = typer.Option("linear", "--head", help="linear | mlp"),
    epochs: int = typer.Option(10, "--epochs"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="rows a step, across all devices (default: "
                                             "an eighth of the train rows as a power of two, at most 4096)"),
    lr: Optional[float] = typer.Option(None, "--lr", help="AdamW learning rate (warm-up, then cosine decay); default 0.001, more for a run of under 2,000 steps (at most 0.01)"),
    where: Optional[str] = typer.Option(None, "--where", callback=check_where, help="SQL filter on the rows (read-only)"),
    val_fraction: float = typer.Option(0.1, "--val-fraction", help="share of rows, by id hash, kept for validation"),
    devices: str = typer.Option("auto", "--devices", help="auto | cpu | cuda | cuda:0,1,… (one process each)"),
    ranks: Optional[int] = typer.Option(None, "--ranks", help="training processes (default one per device; "
                                        "--devices cpu --ranks 2: two gloo processes)"),
    tier: Optional[str] = typer.Option(None, "--tier", help="auto | gpu | ram | stream: where the vectors live "
                                       "(default auto)"),
    workers: Optional[int] = typer.Option(None, "--workers", hidden=True, help="old name of --ranks"),
    cache: Optional[str] = typer.Option(None, "--cache", hidden=True, help="old name of --tier"),
    seed: int = typer.Option(0, "--seed"),
    out: Optional[str] = typer.Option(None, "--out",
                                      help="run directory (default $EMBEDFLEET_HOME/runs/TABLE-LABEL-TIME)"),
    db: Optional[str] = DbOpt,
    json_out: bool = typer.Option(False, "--json", help="print the final metrics document"),
) -> None:
    """Train a head (linear or MLP) on a table's vectors or named columns: one bulk read, batches on the device."""
    from embedfleet.settings import TrainSpec
    from embedfleet.train.trainer import train as run_train

    run_train(TrainSpec(table=table, label=label, task=task, head=head, epochs=epochs, batch_size=batch_size,
                        lr=lr, where=where, val_fraction=val_fraction, devices=devices,
                        workers=_alias(ranks, workers, "--ranks", "--workers"),
                        cache=_alias(tier, cache, "--tier", "--cache") or "auto", seed=seed, out=out, db=db,
                        json=json_out, features=_columns(features), fill_null=fill_null), knobs())


def _columns(value: str | None) -> list[str] | None:
    if value is None:
        return None
    names = [c.strip() for c in value.split(",") if c.strip()]
    if not names:
        raise typer.BadParameter("--features: name at least one column")
    return names


def _alias(new, old, new_name: str, old_name: str):
    """A flag given by its clear name or its old one (kept hidden so that old commands still run), not both."""
    if new is not None and old is not None and new != old:
        raise typer.BadParameter(f"{new_name} and its old name {old_name} disagree; give one")
    return new if new is not None else old


@app.command()
def predict(
    run: str = typer.Option(..., "--run", help="a run directory `embedfleet train` wrote"),
    table: str = typer.Option(..., "--table"),
    where: Optional[str] = typer.Option(None, "--where", callback=check_where, help="SQL filter on the rows (read-only)"),
    out: Optional[str] = typer.Option(None, "--out", help="FILE.parquet: id, prediction, probabilities"),
    db: Optional[str] = DbOpt,
    device: str = typer.Option("auto", "--device"),
    json_out: bool = typer.Option(False, "--json", help="print the summary as JSON"),
) -> None:
    """Apply a trained head to a table's stored vectors and print a summary.

    Where the table has a label column, the summary gives the head's agreement with it."""
    from embedfleet.train.predict import predict as run_predict

    summary = run_predict(run, table, where=where, out=out, db=db, device=device, settings=knobs())
    if json_out:
        emit(summary)
        return
    line = f"{summary['rows']:,} rows of {table!r} predicted"
    if summary.get("accuracy") is not None:
        line += f"; accuracy against {table}'s label {summary['accuracy']:.4f}"
        if summary.get("val_accuracy") is not None:
            line += f" (validation rows {summary['val_accuracy']:.4f})"
    if summary.get("mae") is not None:
        line += f"; MAE against {table}'s label {summary['mae']:.4f}"
        if summary.get("val_mae") is not None:
            line += f" (validation rows {summary['val_mae']:.4f})"
    typer.echo(line)
    if summary.get("unseen_label_rows"):
        typer.echo(f"{table}: {plural(summary['unseen_label_rows'], 'row')} with a label the head was not trained on, "
                   "counted as wrong in the accuracy", err=True)
    if summary.get("skipped_null_vector"):
        typer.echo(f"{table}: {plural(summary['skipped_null_vector'], 'row')} without a vector (NULL), not predicted",
                   err=True)
    typer.echo(f"predicted: {orjson.dumps(summary['predicted']).decode()}")
    if out:
        typer.echo(f"wrote {out}", err=True)

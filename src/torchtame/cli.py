"""The ``optimize`` command line. It parses and prints; the work happens in the library."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.progress import BarColumn, SpinnerColumn, TextColumn, TimeElapsedColumn

from ._version import __version__
from .errors import TorchtameError
from .results import findings_of

err = Console(stderr=True)
out = Console(width=None if sys.stdout.isatty() else 160)


def default_recipe() -> Path:
    """The quickstart recipe embedded in the package (also at recipes/quickstart.yaml)."""
    embedded = resources.files("torchtame") / "recipes" / "quickstart.yaml"
    if embedded.is_file():
        return Path(str(embedded))
    return Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"


class RichProgress:
    """A status line for the pipeline's stage and a bar (done/total, live fields) per task."""

    def __init__(self, progress: Any) -> None:
        self.p = progress
        self.main = progress.add_task("starting", total=None, info="", count="")

    @contextmanager
    def task(self, description: str, total: int | None = None) -> Iterator[Any]:
        tid = self.p.add_task(f"  {description}", total=total, info="", count=f"0/{total or '?'}")
        done = 0

        class _T:
            def advance(_self, n: int = 1, **fields: Any) -> None:
                nonlocal done
                done += n
                info = " ".join(f"{k} {v}" for k, v in fields.items())
                self.p.update(tid, advance=n, info=info, count=f"{done}/{total or '?'}")

        try:
            yield _T()
        finally:
            self.p.remove_task(tid)

    def status(self, message: str) -> None:
        self.p.update(self.main, description=message)


@contextmanager
def rich_progress(console: Console) -> Iterator[RichProgress]:
    """A live display: the pipeline's stage on top, a bar per running task (calibration, ...)."""
    from rich.progress import Progress

    columns = [
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[count]}"),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
    ]
    with Progress(*columns, console=console, transient=True) as p:
        yield RichProgress(p)


class DefaultGroup(click.Group):
    """``optimize RECIPE`` runs a recipe: unknown first words go to the ``run`` command."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or (args[0] not in self.commands and args[0] not in ("--help", "-h", "--version")):
            args = ["run", *args]
        return super().parse_args(ctx, args)


def _setup_logging(debug: bool, quiet: bool) -> None:
    level = logging.DEBUG if debug else (logging.WARNING if quiet else logging.INFO)
    logger = logging.getLogger("torchtame")
    logger.handlers[:] = [RichHandler(console=err, show_path=debug, show_time=False, markup=False)]
    logger.setLevel(level)
    logger.propagate = False


def _fail(exc: BaseException, debug: bool) -> None:
    """Print an error in one or two unwrapped lines (traceback only with --debug) and exit."""
    if debug:
        err.print(traceback.format_exc(), markup=False, highlight=False)
    if isinstance(exc, TorchtameError):
        err.print(f"[bold red]error:[/] {escape(exc.message)}", highlight=False, soft_wrap=True)
        if exc.hint:
            err.print(f"  [yellow]fix:[/] {escape(exc.hint)}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    err.print(
        f"[bold red]internal error:[/] {escape(f'{type(exc).__name__}: {exc}')}",
        highlight=False,
        soft_wrap=True,
    )
    err.print("  rerun with --debug for the traceback, and please report it", highlight=False)
    sys.exit(1)


@click.group(cls=DefaultGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="torchtame")
def main() -> None:
    """torchtame: quantize, prune and export a PyTorch model, and compare every variant.

    \b
    optimize RECIPE.yaml          run a recipe (same as `optimize run RECIPE.yaml`)
    optimize                      run the embedded quickstart recipe (no download)
    optimize env                  show the hardware and backends torchtame sees
    optimize schema               print the recipe JSON schema
    optimize report RUN_DIR       rebuild a run's reports from results.json
    optimize compare RUN_DIR...   set saved runs side by side
    """


@main.command("run")
@click.argument("recipe", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--output-dir",
    "-o",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where run directories go (overrides the recipe's output_dir).",
)
@click.option(
    "--device",
    "-d",
    "devices",
    multiple=True,
    help="Measure on this device: auto, cpu, cuda or cuda:N (repeatable; overrides the recipe).",
)
@click.option(
    "--resume",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Continue an interrupted or failed run in this directory, skipping finished variants.",
)
@click.option(
    "--strict", is_flag=True, help="Exit 1 if any variant failed or has an error-level health finding."
)
@click.option(
    "--ray",
    "ray_address",
    is_flag=False,
    flag_value="local",
    default=None,
    metavar="[ADDRESS]",
    help="Run builds and measurements as Ray tasks: alone, a local Ray instance; `auto` or "
    "host:port, an existing cluster (pip install 'torchtame[ray]').",
)
@click.option("--debug", is_flag=True, help="Show tracebacks and debug logs.")
@click.option("--quiet", "-q", is_flag=True, help="No progress display; only warnings and the table.")
def run_cmd(
    recipe: Path | None,
    output_dir: Path | None,
    devices: tuple[str, ...],
    resume: Path | None,
    strict: bool,
    ray_address: str | None,
    debug: bool,
    quiet: bool,
) -> None:
    """Run RECIPE (default: the embedded quickstart) and print the comparison table.

    Writes <output_dir>/<name>-<timestamp>/ with recipe.yaml, results.json, each variant's
    artefact and report.md / report.html. Exit codes: 0 done, 1 run failure, 2 bad recipe or
    device, 130 interrupted.
    """
    from .pipeline import run
    from .report.table import comparison_table

    _setup_logging(debug, quiet)
    path = recipe or (None if resume else default_recipe())
    try:
        display = contextlib.nullcontext(None) if quiet or not err.is_terminal else rich_progress(err)
        with display as progress:
            execution = None
            if ray_address is not None:
                execution = {"engine": "ray", "address": None if ray_address == "local" else ray_address}
            result = run(
                path,
                output_dir=output_dir,
                devices=list(devices) or None,
                progress=progress,
                resume=resume,
                execution=execution,
            )
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/]: finished variants are kept in the run directory")
        sys.exit(130)
    except Exception as exc:
        _fail(exc, debug)
        return
    out.print(comparison_table(result.results))
    failed = [v["name"] for v in result.results["variants"] if v["status"] != "ok"]
    if failed:
        err.print(f"[yellow]{len(failed)} variant(s) failed:[/] {', '.join(failed)} (see report.md)")
    errors = [
        f"{v['name']}: {f['message']}"
        for v in result.results["variants"]
        for f in findings_of(v)
        if f["level"] == "error"
    ]
    for line in errors[:5]:
        err.print(f"[red]health error[/] {escape(line)}", highlight=False, soft_wrap=True)
    sel = result.results.get("selection")
    if sel:
        if sel["chosen"]:
            out.print(f"[green]chosen:[/] {sel['chosen']} (fastest variant meeting every constraint)")
        else:
            out.print(f"[yellow]no variant meets every constraint;[/] best found: {sel['best_found']}")
    out.print(f"run directory: {result.run_dir}", highlight=False)
    if strict and (failed or errors):
        sys.exit(1)


@main.command()
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), help="Write to a file.")
def schema(output: Path | None) -> None:
    """Print the JSON schema of recipes (for editor validation)."""
    from .recipe import json_schema

    text = json.dumps(json_schema(), indent=2)
    if output:
        output.write_text(text + "\n", encoding="utf-8")
    else:
        click.echo(text)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def env(as_json: bool) -> None:
    """Show CUDA devices, CPU threads and quantized engines, onnxruntime providers."""
    from .devices import detect_environment
    from .report.env import env_table

    info = detect_environment().to_dict()
    if as_json:
        click.echo(json.dumps(info, indent=2))
    else:
        out.print(env_table(info))


@main.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--debug", is_flag=True)
def report(run_dir: Path, debug: bool) -> None:
    """Rebuild report.md and report.html of RUN_DIR from its results.json."""
    from .report import load_results, write_reports
    from .report.table import comparison_table

    try:
        results = load_results(run_dir)
        written = write_reports(run_dir, results, ["md", "html"])
    except Exception as exc:
        _fail(exc, debug)
        return
    out.print(comparison_table(results))
    for p in written:
        out.print(f"wrote {p}", highlight=False)


@main.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option(
    "--format", "fmt", type=click.Choice(["table", "md", "html", "json"]), default="table", show_default=True
)
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), help="Write to a file.")
@click.option("--debug", is_flag=True)
def compare(run_dirs: tuple[Path, ...], fmt: str, output: Path | None, debug: bool) -> None:
    """Set saved runs side by side: every variant of every run in one table."""
    from .report.compare import compare_runs

    try:
        text = compare_runs(list(run_dirs), fmt, console=out if (fmt == "table" and not output) else None)
    except Exception as exc:
        _fail(exc, debug)
        return
    if output:
        output.write_text(text, encoding="utf-8")
        out.print(f"wrote {output}", highlight=False)
    elif text:
        click.echo(text)


@main.command("passes")
def passes_cmd() -> None:
    """List model sources, data sources and passes with their options and defaults."""
    from rich.table import Table

    from .recipe import recipe_model
    from .registry import DATA_SOURCES, MODEL_SOURCES, PASSES

    recipe_model()  # imports (registers) every built-in source and pass
    for title, reg in (("model sources", MODEL_SOURCES), ("data sources", DATA_SOURCES), ("passes", PASSES)):
        table = Table(title=title, show_lines=True)
        table.add_column("name", style="bold")
        table.add_column("what it does")
        table.add_column("options (default)")
        for entry in reg.entries():
            opts = []
            for name, f in entry.options.model_fields.items():
                if name == "source":
                    continue
                default = "required" if f.is_required() else repr(f.get_default(call_default_factory=True))
                opts.append(f"{f.alias or name} ({default})")
            table.add_row(entry.name, entry.summary, ", ".join(opts))
        out.print(table)

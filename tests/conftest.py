"""Shared fixtures: real digits data, small models trained on the spot, a quickstart run."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from torchtame.data import DataBundle, DigitsData, load_data
from torchtame.training import train
from torchtame.zoo import digits_cnn, digits_mlp

ROOT = Path(__file__).resolve().parents[1]

# pytest -n N (pyproject's default, pytest-xdist): the cores are shared out among the workers, so
# no test oversubscribes them; a test marked `serial` (timings, memory peaks) gets the machine to
# itself and every core while it runs (see pytest_runtest_protocol below)
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = torch.get_num_threads()
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(max(1, THREADS // WORKERS))
    os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())  # for the subprocesses tests start


@contextlib.contextmanager
def _share(exclusive: bool) -> Iterator[None]:
    """A readers-writer lock over the test workers (of every run by this user at once: another
    run's load would disturb a timing too): every test holds it shared, a serial test exclusively;
    the gate stops new readers while a writer waits, so it is not starved."""
    import fcntl

    base = Path(tempfile.gettempdir()) / f"torchtame-tests-{os.getuid()}"
    with open(f"{base}.gate", "a") as gate, open(f"{base}.lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        if not exclusive:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            if exclusive:
                fcntl.flock(gate, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[object]:
    """Under pytest -n: each test's whole protocol (session fixtures it sets up included) holds the
    machine shared, a serial test exclusively and with every core."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return (yield)
    serial = item.get_closest_marker("serial") is not None
    with _share(serial):
        before = torch.get_num_threads()
        if serial:
            torch.set_num_threads(THREADS)
        try:
            return (yield)
        finally:
            torch.set_num_threads(before)


@pytest.fixture(scope="session")
def digits() -> DataBundle:
    return load_data(DigitsData(source="digits", batch_size=64), seed=0)


@pytest.fixture(scope="session")
def _trained_cnn(digits: DataBundle) -> torch.nn.Module:
    torch.manual_seed(0)  # the same model whatever ran before: tests compare numbers on it
    model = digits_cnn(width=16, hidden=128)
    train(model, digits.train, epochs=8, lr=3e-3, seed=0)
    return model


@pytest.fixture()
def trained_cnn(_trained_cnn: torch.nn.Module) -> torch.nn.Module:
    """A digits CNN at ~98% accuracy (a fresh copy per test)."""
    return copy.deepcopy(_trained_cnn)


@pytest.fixture(scope="session")
def _trained_mlp(digits: DataBundle) -> torch.nn.Module:
    torch.manual_seed(0)
    model = digits_mlp(hidden=256)
    train(model, digits.train, epochs=6, lr=3e-3, seed=0)
    return model


@pytest.fixture()
def trained_mlp(_trained_mlp: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(_trained_mlp)


def accuracy(model: torch.nn.Module, loader) -> float:
    """Top-1 accuracy in percent."""
    from torchtame.evaluate import top1_accuracy

    return round(top1_accuracy(model, loader), 3)


def tiny_recipe(tmp_path: Path, **overrides) -> dict:
    """A fast recipe on digits with a small CNN (few latency runs)."""
    recipe = {
        "name": "tiny",
        "output_dir": str(tmp_path / "runs"),
        "model": {
            "source": "python",
            "target": "torchtame.zoo:digits_cnn",
            "kwargs": {"width": 8, "hidden": 64},
            "train": {"epochs": 3, "lr": 0.005},
        },
        "data": {"source": "digits", "batch_size": 64},
        "devices": ["cpu"],
        "steps": [],
        # one CPU memory reading per variant and batch (the default median of three is for users)
        "evaluate": {
            "latency": {"batch_sizes": [1], "warmup": 1, "min_runs": 3, "min_time_s": 0},
            "memory_repeats": 1,
        },
        "report": {"formats": ["json", "md"]},
    }
    evaluate = {**recipe["evaluate"], **overrides.pop("evaluate", {})}
    recipe.update(overrides, evaluate=evaluate)
    return recipe


def run_cli(*args: str, cwd: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run `python -m torchtame ARGS` as a user would (no terminal: no progress bars)."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", COLUMNS="200")
    return subprocess.run(
        [sys.executable, "-m", "torchtame", *args],
        cwd=cwd or ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    """The quickstart recipe run once through the CLI, as the README runs it."""
    out = tmp_path_factory.mktemp("quickstart")
    proc = run_cli("recipes/quickstart.yaml", "--output-dir", str(out))
    dirs = [d for d in out.iterdir() if d.is_dir() and not d.name.startswith(".")]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(dirs) == 1, dirs
    return proc, dirs[0]


def load_results(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text())

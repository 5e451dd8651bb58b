"""The Ray execution engine (`execution: {engine: ray}`, `--ray`): a run's builds and measurements
as Ray tasks (:mod:`.ray_tasks`), scheduled by :mod:`.ray_runner`.

- Every step's build (pass, calibration, fine-tuning, export) is a task with the CPUs (torch
  threads) and GPUs it needs; a step is submitted once its parent is built.
- Every measurement is a task that holds the node's measuring slot and, by default, all of the
  node's CPUs: nothing is built beside a timing. Every latency records its node; the baseline is
  timed on every measuring node, so each speed-up compares measurements of one node.
- A task whose worker is lost becomes a failed variant with the reason; the run goes on. Ctrl-C
  cancels every task in flight.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from ..errors import RunError, first_line
from ..optional import require
from ..recipe import ExecutionConfig
from ..registry import register_engine
from .ray_runner import Schedule
from .ray_tasks import LOCAL_IP, MEASURE, SLOT, Package, build_task, measure_task

if TYPE_CHECKING:
    from ..pipeline.engine import StepHost
    from ..pipeline.executor import Job
    from ..results import VariantEntry
    from ..variant import Variant

log = logging.getLogger("torchtame")


class RayEngine:
    """Connects to (or starts) a Ray cluster and runs a run's builds and measurements on it as
    tasks (the :class:`~torchtame.pipeline.engine.Engine` protocol)."""

    parallel = True

    def __init__(
        self, address: str | None, max_parallel: int | None, step_cpus: int, exclusive: bool
    ) -> None:
        self.ray = require("ray", "the ray execution engine", RunError)
        self.max_parallel = max_parallel
        self.step_cpus = step_cpus
        self.exclusive = exclusive
        self.started = False
        if not self.ray.is_initialized():
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            if address is None:  # a local Ray instance on a loopback address, for this run
                self.ray.init(
                    resources={MEASURE: 1},
                    _node_ip_address=LOCAL_IP,
                    include_dashboard=False,
                    log_to_driver=False,
                    configure_logging=False,
                )
                self.started = True
            else:
                try:
                    self.ray.init(address=address, log_to_driver=False, configure_logging=False)
                except Exception as exc:
                    raise RunError(
                        f"cannot connect to the Ray cluster at {address!r}: {first_line(exc, 200)}",
                        hint="start one (`ray start --head --resources '{\"torchtame_measure\": 1}'`) or "
                        "drop the address to start a local one",
                    ) from exc
        self.nodes = self.measuring_nodes()
        if not self.nodes:
            raise RunError(
                f"no node of the Ray cluster has the `{MEASURE}` resource, so nothing could be measured",
                hint=f"start each node with `ray start ... --resources {SLOT}`",
            )
        largest = max(n["Resources"].get("CPU", 0) for n in self.ray.nodes() if n.get("Alive"))
        if step_cpus > largest:  # such a task could never be scheduled: the run would wait forever
            raise RunError(
                f"execution.step_cpus is {step_cpus}, but no node of the Ray cluster has more than "
                f"{largest:g} CPUs",
                hint=f"set `execution.step_cpus` to at most {largest:g}",
            )
        self._build = self.ray.remote(max_retries=0)(build_task)
        self._measure = self.ray.remote(max_retries=0)(measure_task)
        self._current: Schedule | None = None

    def measuring_nodes(self) -> list[dict[str, Any]]:
        return [n for n in self.ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(MEASURE, 0) >= 1]

    def describe(self) -> dict[str, Any]:
        return {
            "engine": "ray",
            "ray": self.ray.__version__,
            "nodes": [
                {"node": n["NodeID"], "address": n["NodeManagerAddress"], "cpus": n["Resources"].get("CPU")}
                for n in self.nodes
            ],
            "started_local_cluster": self.started,
        }

    def submit_build(
        self,
        recipe_json: str,
        job: dict[str, Any],
        parent: Package,
        baseline: Package | None,
        context: dict[str, Any],
        gpus: float,
    ) -> Any:
        return self._build.options(num_cpus=self.step_cpus, num_gpus=gpus).remote(
            recipe_json, job, parent, baseline, {**context, "threads": self.step_cpus}
        )

    def submit_measure(
        self,
        recipe_json: str,
        package: Package,
        context: dict[str, Any],
        gpus: float,
        node: str | None = None,
        accuracy: bool = True,
    ) -> Any:
        cpus = self._cpus(node)
        options: dict[str, Any] = {"num_cpus": cpus, "num_gpus": gpus, "resources": {MEASURE: 1}}
        if node is not None:
            strategy = self.ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                node_id=node, soft=False
            )
            options["scheduling_strategy"] = strategy
        threads = context.get("threads") or int(cpus)
        return self._measure.options(**options).remote(
            recipe_json, package, {**context, "threads": threads}, accuracy
        )

    def _cpus(self, node: str | None) -> float:
        if not self.exclusive:
            return 1
        cpus = [n["Resources"].get("CPU", 1) for n in self.nodes if node is None or n["NodeID"] == node]
        return min(cpus) if cpus else 1

    def wait(self, refs: list[Any], timeout: float | None = None) -> tuple[list[Any], list[Any]]:
        return self.ray.wait(refs, num_returns=1, timeout=timeout)

    def get(self, ref: Any) -> tuple[Any, str | None]:
        """The task's result, or (None, why there is none)."""
        errors = self.ray.exceptions
        try:
            return self.ray.get(ref), None
        except errors.RayTaskError as exc:  # the task itself raised
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            return None, f"failed on the Ray worker: {type(cause).__name__}: {first_line(cause, 200)}"
        except errors.RayError as exc:  # the worker or its node went away
            return None, f"the Ray worker was lost ({type(exc).__name__}): {first_line(exc, 200)}"

    def cancel(self, refs: list[Any]) -> None:
        for ref in refs:
            try:
                self.ray.cancel(ref, force=True)
            except Exception as exc:  # already finished, or its worker already gone
                log.debug("cancel: %s", exc)

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()

    # ---------------------------------------------------------------- the Engine protocol

    def _schedule(self, host: StepHost) -> Schedule:
        if self._current is None or self._current.host is not host:
            self._current = Schedule(self, host)
        return self._current

    def measure_baseline(self, host: StepHost, baseline: Variant) -> VariantEntry:
        return self._schedule(host).measure_baseline(baseline)

    def run_steps(self, host: StepHost, jobs: list[Job]) -> list[VariantEntry]:
        return self._schedule(host).run(jobs)

    def retime(self, host: StepHost) -> None:
        """No side-by-side rounds: each speed-up already compares one node's measurements, and
        the rounds would have to hold every node's measuring slot at once."""
        if host.recipe.evaluate.latency.rounds > 1:
            log.info("latency.rounds is not used by the ray engine: every figure is one timing")


@register_engine("ray")
def make_engine(config: ExecutionConfig) -> RayEngine:
    """Builds and measurements as tasks on a Ray cluster (a local one unless ``address``)."""
    return RayEngine(config.address, config.max_parallel, config.step_cpus, config.exclusive_measure)

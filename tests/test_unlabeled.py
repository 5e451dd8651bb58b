"""Optimization without labels: fidelity constraints, a search that reaches them for both back ends,
and recovery by distillation from the baseline."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torchtame import DataError, PassError, apply_pass, load_data, run
from torchtame.data import DigitsData

from .conftest import tiny_recipe
from .test_search import PLANTED


def agreement(a: torch.nn.Module, b: torch.nn.Module, loader) -> float:
    with torch.inference_mode():
        x = torch.cat([x for x, _ in loader])
        return 100.0 * (a(x).argmax(1) == b(x).argmax(1)).float().mean().item()


# These tests judge what distillation recovers, so the pruning leaves out the least-squares refit
# (`reconstruct`), which alone recovers most of it on these small models (tests/test_reconstruct.py).
NO_REFIT = {"reconstruct": False}


def test_distillation_recovers_a_pruned_model_without_labels(trained_cnn, digits) -> None:
    pruned = apply_pass("prune.structured", trained_cnn, digits, {"ratio": 0.5, **NO_REFIT})
    before = agreement(pruned.module, trained_cnn, digits.evaluation)
    unlabelled = load_data(DigitsData(source="digits", batch_size=64, labels="ignore"), 0)
    assert not unlabelled.has_labels
    tuned = apply_pass(
        "finetune", pruned, unlabelled, {"loss": "distill", "epochs": 4, "lr": 2e-3}, baseline=trained_cnn
    )
    after = agreement(tuned.module, trained_cnn, digits.evaluation)
    assert tuned.info["loss"] == "distill" and tuned.info["teacher"] == "baseline"
    assert before < 90 and after >= 97, (before, after)
    from .conftest import accuracy

    assert accuracy(tuned.module, digits.evaluation) >= accuracy(trained_cnn, digits.evaluation) - 1.5


def test_distillation_of_an_embedding_uses_cosine() -> None:
    from .realmodels import DictOutput

    data = load_data(DigitsData(source="digits", batch_size=64, labels="ignore"), 0)
    torch.manual_seed(0)
    model = DictOutput().eval()
    kw = {"output": "embedding", "task": "features"}
    pruned = apply_pass("prune.structured", model, data, {"ratio": 0.5, **NO_REFIT}, **kw)
    tuned = apply_pass(
        "finetune", pruned, data, {"loss": "distill", "epochs": 3, "lr": 3e-3}, baseline=model, **kw
    )
    x = data.example_input(128)

    def cos(m):
        with torch.inference_mode():
            return (
                torch.nn.functional.cosine_similarity(m(x)["embedding"], model(x)["embedding"]).mean().item()
            )

    assert cos(tuned.module) > cos(pruned.module) + 0.05 and cos(tuned.module) >= 0.9


def test_cross_entropy_without_labels_says_to_distill(trained_cnn) -> None:
    withheld = load_data(DigitsData(source="digits", batch_size=64, labels="report_only"), 0)
    assert withheld.has_labels and not withheld.use_labels
    pruned = apply_pass("prune.structured", trained_cnn, withheld, {"ratio": 0.5})
    with pytest.raises(DataError, match="loss: distill"):
        apply_pass("finetune", pruned, withheld, {"epochs": 1}, baseline=trained_cnn)
    with pytest.raises(PassError, match="baseline itself"):
        apply_pass("finetune", trained_cnn, withheld, {"loss": "distill", "epochs": 1})


def test_prune_with_distillation_between_steps(trained_cnn, digits) -> None:
    opts = {"ratio": 0.6, "iterative_steps": 3}
    plain = apply_pass("prune.structured", trained_cnn, digits, opts)
    distilled = apply_pass(
        "prune.structured",
        trained_cnn,
        digits,
        {**opts, "finetune_between": {"loss": "distill", "steps": 40}},
    )
    assert agreement(distilled.module, trained_cnn, digits.evaluation) > agreement(
        plain.module, trained_cnn, digits.evaluation
    )


def test_search_without_labels_meets_fidelity_and_reports_real_accuracy(tmp_path: Path) -> None:
    recipe = tiny_recipe(
        tmp_path,
        data={"source": "digits", "batch_size": 64, "labels": "report_only"},
        strategy="search",
        constraints={"min_agreement": 98},
        search={
            "prune_ratios": [0.25, 0.75],
            "finetune": {"loss": "distill", "epochs": 2, "lr": 0.003},
            "onnx_methods": ["MinMax"],
            "max_float_layers": 1,
        },
    )
    result = run(recipe)
    res = result.results
    assert res["data"]["labels"] == "report_only" and res["search"]["objective"] == "agreement"
    assert res["search"]["sensitivity"]["basis"].startswith("top-1 agreement")
    sel = res["selection"]
    chosen = result.variant(sel["chosen"])
    assert chosen["accuracy"]["top1_agreement"] >= 98
    assert "top1" in chosen["accuracy"]  # the report still shows the real accuracy
    verdicts = {c["name"]: c for c in sel["candidates"]}
    assert all("top-1" not in " ".join(c["reasons"]) for c in verdicts.values())  # labels unused
    assert (
        any(s["family"] == "onnxruntime" for s in res["search"]["stopped"])
        or "search-onnx-int8-minmax" in verdicts
    )
    md = (result.run_dir / "report.md").read_text()
    assert "withheld from the optimizer" in md and "## Selection" in md


def test_max_accuracy_drop_uses_agreement_when_labels_are_withheld() -> None:
    from torchtame.recipe import Constraints
    from torchtame.search.selection import select

    entry = {
        "name": "q",
        "status": "ok",
        "accuracy": {"top1_drop": 0.0, "top1_agreement": 90.0},
        "latency": [{"device": "cpu", "batch_size": 1, "p50_ms": 1.0}],
        "size": {"bytes": 1},
    }
    c = Constraints(max_accuracy_drop=5.0)
    used = select({"data": {"labels": "use"}, "variants": [entry]}, c, "cpu", 1)
    withheld = select({"data": {"labels": "report_only"}, "variants": [entry]}, c, "cpu", 1)
    assert used["chosen"] == "q" and withheld["chosen"] is None
    assert "(agreement)" in withheld["candidates"][0]["reasons"][0]


def test_onnx_candidates_exclude_the_sensitive_node(tmp_path: Path) -> None:
    """The planted layer that int8 destroys (tests/test_search.py) also breaks onnxruntime's
    int8: every calibration misses the constraint, and excluding the node mapped from the most
    sensitive torch layer meets it."""
    recipe = tiny_recipe(
        tmp_path,
        model=PLANTED,
        strategy="search",
        constraints={"min_agreement": 97},
        search={
            "quantize": False,
            "prune": False,
            "onnx_methods": ["MinMax", "Percentile"],
            "onnx_options": {"per_channel": False},
            "max_float_layers": 1,
        },
    )
    result = run(recipe)
    names = [v["name"] for v in result.results["variants"]]
    assert "search-onnx-int8-minmax" in names and "search-onnx-int8-percentile" in names
    rescue = [n for n in names if n.endswith("-float1")]
    assert rescue, names
    v = result.variant(rescue[0])
    excluded = v["info"]["nodes_excluded"]
    assert excluded[0] == "node_linear_1" and "node_cat" in excluded  # the node and its float input
    assert v["info"]["graph"]["float_layers"] == ["node_linear_1"]
    assert v["accuracy"]["top1_agreement"] >= 97
    assert result.results["selection"]["chosen"] is not None


def test_distillation_on_nearly_flat_class_scores_can_match_the_scores() -> None:
    """A random-weight model's class scores are nearly flat: the softened KL barely moves them
    (here it even lowers fidelity), while `logits_loss: cosine` learns the scores themselves."""
    from torchtame.zoo import digits_cnn

    data = load_data(DigitsData(source="digits", batch_size=64, labels="ignore"), 0)
    torch.manual_seed(0)
    model = digits_cnn(width=16, hidden=128).eval()
    kw = {"task": "classification"}
    pruned = apply_pass("prune.structured", model, data, {"ratio": 0.5, **NO_REFIT}, **kw)
    x = data.example_input(256)

    def cos(m: torch.nn.Module) -> float:
        with torch.inference_mode():
            return torch.nn.functional.cosine_similarity(m(x), model(x)).mean().item()

    after = {}
    for loss in ("kl", "cosine"):
        opts = {"loss": "distill", "epochs": 2, "lr": 2e-3, "logits_loss": loss}
        after[loss] = cos(apply_pass("finetune", pruned, data, opts, baseline=model, **kw).module)
    assert after["cosine"] > max(after["kl"], cos(pruned.module)) + 1e-3, after


class _Spy(torch.nn.Module):
    """A linear classifier that records the inputs it was called with."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc = torch.nn.Linear(4, 3)
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.detach().clone())
        return self.fc(x)


def test_mixup_shows_teacher_and_student_the_same_mixed_inputs_and_mixes_labels() -> None:
    from torchtame.training import Distill, Mixup, _Objective

    x, y = torch.randn(8, 4), torch.arange(8) % 3
    student, teacher = _Spy(0), _Spy(1)
    objective = _Objective(student, Distill(teacher, logits_loss="mse"), None, True, Mixup(0.4, seed=3))
    loss = objective(x, y, 0)
    mixed = student.seen[0]
    assert torch.equal(mixed, teacher.seen[0]) and not torch.allclose(mixed, x)
    again, perm, lam = Mixup(0.4, seed=3)(x)  # reproducible from the seed
    assert torch.equal(again, mixed) and 0 < lam < 1
    assert torch.allclose(mixed, lam * x + (1 - lam) * x[perm])
    assert torch.allclose(loss, torch.nn.functional.mse_loss(student.fc(mixed), teacher.fc(mixed)))
    # cross-entropy weighs both labels of each mixed input
    ce = _Objective(student, None, None, True, Mixup(0.4, seed=3))(x, y, 0)
    out = student.fc(mixed)
    ref = lam * torch.nn.functional.cross_entropy(out, y) + (1 - lam) * torch.nn.functional.cross_entropy(
        out, y[perm]
    )
    assert torch.allclose(ce, ref)


def test_mixup_refuses_token_ids_before_a_step_and_trains_a_distillation(trained_cnn) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    from torchtame.training import Distill, train

    tokens = DataLoader(
        TensorDataset(torch.randint(0, 9, (8, 4)), torch.zeros(8, dtype=torch.long)), batch_size=4
    )
    student = torch.nn.Sequential(torch.nn.Embedding(9, 3), torch.nn.Flatten(), torch.nn.Linear(12, 3))
    before = [p.detach().clone() for p in student.parameters()]
    with pytest.raises(DataError, match=r"mixup.*int64") as err:
        train(student, tokens, steps=2, distill=Distill(student), mixup=0.4)
    assert "mixup: 0" in str(err.value.hint)
    assert all(torch.equal(a, b) for a, b in zip(before, student.parameters(), strict=True))
    data = load_data(DigitsData(source="digits", batch_size=64, labels="ignore"), 0)
    pruned = apply_pass("prune.structured", trained_cnn, data, {"ratio": 0.5, **NO_REFIT})
    opts = {"loss": "distill", "epochs": 2, "lr": 2e-3, "mixup": 0.4}
    tuned = apply_pass("finetune", pruned, data, opts, baseline=trained_cnn)
    digits = load_data(DigitsData(source="digits", batch_size=64), 0)
    assert agreement(tuned.module, trained_cnn, digits.evaluation) > agreement(
        pruned.module, trained_cnn, digits.evaluation
    )

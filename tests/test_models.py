"""The BERT encoder: parity with Hugging Face, checkpoint loading and its errors, positions, heads.

The independent reference is tests/golden/minilm_golden.npz: all-MiniLM-L6-v2 hidden states
computed once by Hugging Face transformers (PyTorch, CPU) with tests/golden/make_minilm_golden.py.
Every impl in fl.IMPLS must reproduce them; none is skipped.
"""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

import flash_layers as fl
from flash_layers import models

GOLDEN = pathlib.Path(__file__).parent / "golden" / "minilm_golden.npz"
PAD_TO = 128  # golden batch (5 x 45) padded with segment id 0: the padding must change nothing


@pytest.fixture(scope="module")
def golden():
  return dict(np.load(GOLDEN))


@pytest.fixture(scope="module")
def minilm():
  return models.from_pretrained("all-MiniLM-L6-v2", impl="reference")


def padded(golden):
  ids = np.zeros((len(golden["input_ids"]), PAD_TO), np.int32)
  seg = np.zeros_like(ids)
  n = golden["input_ids"].shape[1]
  ids[:, :n] = golden["input_ids"]
  seg[:, :n] = golden["attention_mask"]
  return jnp.asarray(ids), jnp.asarray(seg)


def encode(model, params, ids, seg, **kwargs):
  fn = jax.jit(lambda p, i, s: model.apply({"params": p}, i, segment_ids=s, method=model.encode, **kwargs))
  return np.asarray(fn(params, ids, seg), np.float32)


def real_tokens(golden):
  n = golden["input_ids"].shape[1]
  mask = np.zeros((len(golden["input_ids"]), PAD_TO), bool)
  mask[:, :n] = golden["attention_mask"].astype(bool)
  return mask


@pytest.mark.parametrize("impl", fl.IMPLS)
def test_minilm_matches_hugging_face(impl, minilm, golden):
  model, params = minilm
  ids, seg = padded(golden)
  hidden = encode(model.clone(impl=impl), params, ids, seg)
  assert hidden.shape == (5, PAD_TO, 384)
  mask = real_tokens(golden)
  want = golden["last_hidden_state"][golden["attention_mask"].astype(bool)]
  np.testing.assert_allclose(hidden[mask], want, atol=1e-4, rtol=0)


def test_bfloat16_compute_stays_close(minilm, golden):
  model, params = minilm
  ids, seg = padded(golden)
  hidden = encode(model.clone(dtype=jnp.bfloat16), params, ids, seg)
  want = golden["last_hidden_state"][golden["attention_mask"].astype(bool)]
  err = np.abs(hidden[real_tokens(golden)] - want)
  assert err.mean() < 0.05 and err.max() < 1.0, (err.mean(), err.max())


def test_packed_documents_encode_as_if_alone(minilm, golden):
  """Two documents in one row (segment ids 1, 2; positions restarting) = each encoded on its own."""
  model, params = minilm
  lens = golden["attention_mask"].sum(1)
  a, b = golden["input_ids"][0, :lens[0]], golden["input_ids"][1, :lens[1]]
  ids = np.zeros((1, 64), np.int32)
  seg = np.zeros((1, 64), np.int32)
  ids[0, :len(a)], ids[0, len(a):len(a) + len(b)] = a, b
  seg[0, :len(a)], seg[0, len(a):len(a) + len(b)] = 1, 2
  hidden = encode(model, params, jnp.asarray(ids), jnp.asarray(seg))
  np.testing.assert_allclose(hidden[0, :len(a)], golden["last_hidden_state"][0, :len(a)], atol=1e-4)
  np.testing.assert_allclose(hidden[0, len(a):len(a) + len(b)], golden["last_hidden_state"][1, :len(b)],
                             atol=1e-4)


def test_mean_pooling_classifies_each_packed_document(minilm, golden):
  """Mean pooling per document equals the mean of that document's hidden states, then the head."""
  model, params = minilm
  model = model.clone(impl="xla_native", num_labels=3, pooling="mean")
  rng = np.random.default_rng(0)
  head = {"kernel": jnp.asarray(rng.normal(size=(384, 3)), jnp.float32),
          "bias": jnp.asarray(rng.normal(size=3), jnp.float32)}
  params = {**params, "classifier": head}
  ids, seg = padded(golden)
  hidden = encode(model, params, ids, seg)
  logits = np.asarray(jax.jit(lambda p: model.apply({"params": p}, ids, seg, max_docs=2))(params))
  assert logits.shape == (5, 2, 3)
  mask = real_tokens(golden)
  for row in range(5):
    mean = hidden[row][mask[row]].mean(0)
    np.testing.assert_allclose(logits[row, 0], mean @ head["kernel"] + head["bias"], atol=1e-4)
    np.testing.assert_allclose(logits[row, 1], head["bias"], atol=1e-6)  # no document 2: zeros pooled


# ----------------------------------------------------------------------------
# Position extension
# ----------------------------------------------------------------------------

def test_extend_positions_repeat_and_interpolate():
  table = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
  rep = models.extend_positions(table, 10, "repeat")
  np.testing.assert_array_equal(rep, np.concatenate([table, table, table[:2]]))
  interp = models.extend_positions(table, 7, "interpolate")
  np.testing.assert_array_equal(interp[:4], table)
  # row p >= 4 samples the table at p * 3 / 6 = p / 2: rows 4, 5, 6 -> 2.0, 2.5, 3.0
  np.testing.assert_allclose(interp[4:], [table[2], (table[2] + table[3]) / 2, table[3]], rtol=1e-6)
  assert models.extend_positions(table, 3, "repeat") is table
  with pytest.raises(ValueError, match="position_extension must be one of"):
    models.extend_positions(table, 8, "rope")


@pytest.mark.parametrize("how", models.POSITION_EXTENSIONS)
def test_long_model_keeps_the_first_512_positions(how, minilm, golden):
  _, params512 = minilm
  model, params = models.from_pretrained("all-MiniLM-L6-v2", impl="xla_native", max_len=1300,
                                         position_extension=how)
  table = np.asarray(params["position_embeddings"]["embedding"])
  assert table.shape == (1300, 384) and model.max_len == 1300
  np.testing.assert_array_equal(table[:512], np.asarray(params512["position_embeddings"]["embedding"]))
  if how == "repeat":
    np.testing.assert_array_equal(table[512:1024], table[:512])
    ids, _ = padded(golden)
    long_ids = jnp.tile(ids[:1, :100], (1, 13))  # 1300 tokens: runs past the old table
    out = encode(model, params, long_ids, jnp.ones_like(long_ids))
    assert out.shape == (1, 1300, 384) and np.isfinite(out).all()
  with pytest.raises(ValueError, match="exceeds max_len=1300"):
    model.apply({"params": params}, jnp.zeros((1, 1301), jnp.int32), method=model.encode)


# ----------------------------------------------------------------------------
# Checkpoint errors, on a tiny hand-written checkpoint
# ----------------------------------------------------------------------------

TINY = dict(vocab_size=40, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16,
            max_position_embeddings=16, type_vocab_size=2, model_type="bert")


def tiny_tensors(seed=0):
  """HF BertModel tensor names and torch shapes, written from the HF layout (not from our loader)."""
  h, m = TINY["hidden_size"], TINY["intermediate_size"]
  shapes = {"embeddings.word_embeddings.weight": (TINY["vocab_size"], h),
            "embeddings.position_embeddings.weight": (TINY["max_position_embeddings"], h),
            "embeddings.token_type_embeddings.weight": (2, h),
            "embeddings.LayerNorm.weight": (h,), "embeddings.LayerNorm.bias": (h,)}
  for i in range(TINY["num_hidden_layers"]):
    p = f"encoder.layer.{i}."
    for name in ("attention.self.query", "attention.self.key", "attention.self.value",
                 "attention.output.dense"):
      shapes[p + name + ".weight"], shapes[p + name + ".bias"] = (h, h), (h,)
    shapes[p + "intermediate.dense.weight"], shapes[p + "intermediate.dense.bias"] = (m, h), (m,)
    shapes[p + "output.dense.weight"], shapes[p + "output.dense.bias"] = (h, m), (h,)
    for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
      shapes[p + ln + ".weight"], shapes[p + ln + ".bias"] = (h,), (h,)
  rng = np.random.default_rng(seed)
  return {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}


def write_checkpoint(path, tensors, **config):
  path.mkdir(exist_ok=True)
  (path / "config.json").write_text(json.dumps({**TINY, **config}))
  save_file(tensors, str(path / "model.safetensors"))
  return path


def test_tiny_checkpoint_loads_every_tensor_in_place(tmp_path):
  tensors = tiny_tensors()
  model, params = models.from_pretrained(write_checkpoint(tmp_path / "ok", tensors), impl="reference")
  q = tensors["encoder.layer.1.attention.self.query.weight"]
  np.testing.assert_array_equal(params["layers_1"]["attention"]["query"]["kernel"], q.T.reshape(8, 2, 4))
  o = tensors["encoder.layer.0.attention.output.dense.weight"]
  np.testing.assert_array_equal(params["layers_0"]["attention"]["out"]["kernel"], o.T.reshape(2, 4, 8))
  np.testing.assert_array_equal(params["layers_0"]["mlp_in"]["kernel"],
                                tensors["encoder.layer.0.intermediate.dense.weight"].T)
  # A BertForX checkpoint ("bert." prefix, old gamma/beta names) loads the same.
  renamed = {"bert." + k.replace("LayerNorm.weight", "LayerNorm.gamma"): v for k, v in tensors.items()}
  _, params2 = models.from_pretrained(write_checkpoint(tmp_path / "prefixed", renamed))
  jax.tree.map(np.testing.assert_array_equal, params, params2)


def test_missing_tensor_is_named(tmp_path):
  tensors = tiny_tensors()
  del tensors["encoder.layer.1.output.dense.bias"]
  with pytest.raises(models.CheckpointError,
                     match=r"missing tensor\(s\).*encoder\.layer\.1\.output\.dense\.bias"):
    models.from_pretrained(write_checkpoint(tmp_path / "c", tensors))


def test_misshaped_tensor_is_named(tmp_path):
  tensors = tiny_tensors()
  name = "encoder.layer.0.intermediate.dense.weight"
  tensors[name] = tensors[name].T
  with pytest.raises(models.CheckpointError,
                     match=r"intermediate\.dense\.weight' has shape \(8, 16\).*needs \(16, 8\)"):
    models.from_pretrained(write_checkpoint(tmp_path / "c", tensors))


def test_bad_directories_and_configs(tmp_path):
  with pytest.raises(FileNotFoundError, match="not a directory"):
    models.from_pretrained(tmp_path / "nowhere")
  with pytest.raises(models.CheckpointError, match="model_type 'gpt2'"):
    models.from_pretrained(write_checkpoint(tmp_path / "g", tiny_tensors(), model_type="gpt2"))
  (tmp_path / "g" / "model.safetensors").unlink()
  (tmp_path / "g" / "config.json").write_text(json.dumps(TINY))
  with pytest.raises(models.CheckpointError, match="no model.safetensors"):
    models.from_pretrained(tmp_path / "g")
  with pytest.raises(TypeError, match="unknown override"):
    models.from_pretrained(write_checkpoint(tmp_path / "h", tiny_tensors()), colour="blue")


# ----------------------------------------------------------------------------
# Options on a tiny random model
# ----------------------------------------------------------------------------

def tiny_model(**kwargs):
  fields = dict(vocab_size=40, hidden_size=16, num_layers=2, num_heads=2, mlp_dim=32, max_len=32,
                num_labels=3, impl="xla_native")
  return models.Bert(**{**fields, **kwargs})


@pytest.fixture(scope="module")
def tiny_params():
  """Params for every head of tiny_model(); compiled once (an eager init is slow on a busy CPU)."""
  model = tiny_model(mlm_head=True)
  return jax.jit(lambda: models.init_params(model, jax.random.key(0)))()


def tiny_batch():
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(1, 40, size=(2, 12)), jnp.int32)
  seg = jnp.asarray([[1] * 5 + [2] * 4 + [0] * 3, [1] * 12], jnp.int32)
  return ids, seg


def test_remat_gives_the_same_gradients(tiny_params):
  ids, seg = tiny_batch()
  params = {k: v for k, v in tiny_params.items() if not k.startswith("mlm")}

  def grads(model):
    loss = lambda p: model.apply({"params": p}, ids, seg, max_docs=2).sum()
    return jax.jit(jax.grad(loss))(params)

  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
               grads(tiny_model()), grads(tiny_model(remat=True, remat_policy="dots_saveable")))


def test_hidden_dropout_is_active_only_when_not_deterministic(tiny_params):
  ids, seg = tiny_batch()
  model = tiny_model(dropout_rate=0.5)
  apply = jax.jit(lambda key, det: model.apply({"params": tiny_params}, ids, seg, method=model.encode,
                                               deterministic=det, rngs={"dropout": key}), static_argnums=1)
  run = lambda det, key: np.asarray(apply(key, det))
  np.testing.assert_array_equal(run(True, jax.random.key(1)), run(True, jax.random.key(2)))
  assert not np.allclose(run(False, jax.random.key(1)), run(False, jax.random.key(2)))


def test_attention_dropout_trains_and_is_the_same_under_every_impl(tiny_params):
  """Attention dropout alone (no hidden dropout): on in training, off in eval, one mask for every impl."""
  ids, seg = tiny_batch()
  params = {k: v for k, v in tiny_params.items() if not k.startswith("mlm")}

  def loss(impl, rate, deterministic):
    model = tiny_model(impl=impl, dropout_rate=0.0, attention_dropout_rate=rate)
    fn = lambda p: model.apply({"params": p}, ids, seg, max_docs=2, deterministic=deterministic,
                               rngs={"dropout": jax.random.key(3)})
    return lambda p: jnp.sum(jnp.sin(fn(p)))

  train, train_grad = jax.jit(jax.value_and_grad(loss("xla_chunked", 0.3, False)))(params)
  ref, ref_grad = jax.jit(jax.value_and_grad(loss("reference", 0.3, False)))(params)
  np.testing.assert_allclose(train, ref, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), train_grad, ref_grad)
  evaluated = jax.jit(loss("xla_chunked", 0.3, True))(params)
  np.testing.assert_allclose(evaluated, jax.jit(loss("xla_native", 0.0, False))(params), rtol=1e-5)
  assert not np.isclose(train, evaluated, rtol=1e-3)


def test_attention_dropout_comes_from_the_checkpoint(tmp_path):
  path = write_checkpoint(tmp_path / "ckpt", tiny_tensors(), attention_probs_dropout_prob=0.25)
  model, _ = models.from_pretrained(path, impl="reference")
  assert model.attention_dropout_rate == 0.25
  assert model.dropout_rate == TINY.get("hidden_dropout_prob", 0.1)
  model, _ = models.from_pretrained(path, impl="reference", attention_dropout_rate=0.0)
  assert model.attention_dropout_rate == 0.0
  assert models.pretrained.attention_dropout_of("all-MiniLM-L6-v2") == 0.1


def test_cls_pooling_reads_each_documents_first_token(tiny_params):
  ids, seg = tiny_batch()
  model = tiny_model()
  params = tiny_params
  hidden, logits = jax.jit(lambda p: (model.apply({"params": p}, ids, seg, method=model.encode),
                                      model.apply({"params": p}, ids, seg, max_docs=2)))(params)
  pool, head = params["pooler"], params["classifier"]
  for row, doc, first in ((0, 0, 0), (0, 1, 5), (1, 0, 0)):
    pooled = np.tanh(hidden[row, first] @ pool["kernel"] + pool["bias"])
    np.testing.assert_allclose(logits[row, doc], pooled @ head["kernel"] + head["bias"], atol=1e-5)


def test_positions_restart_per_document():
  seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
  np.testing.assert_array_equal(models.positions_from_segments(seg),
                                [[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7]])


def test_mlm_head_is_tied_to_the_word_embeddings(tiny_params):
  ids, seg = tiny_batch()
  model = tiny_model(mlm_head=True, num_labels=None)
  params = tiny_params
  logits = model.apply({"params": params}, ids, seg, method=model.mlm)
  assert logits.shape == (2, 12, 40)
  hidden = model.apply({"params": params}, ids, seg, method=model.encode)
  t = params["mlm_transform"]
  x = jax.nn.gelu(hidden @ t["kernel"] + t["bias"], approximate=False)
  mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
  x = (x - mu) / jnp.sqrt(var + 1e-12) * params["mlm_norm"]["scale"] + params["mlm_norm"]["bias"]
  want = x @ params["word_embeddings"]["embedding"].T + params["mlm_bias"]
  np.testing.assert_allclose(logits, want, atol=1e-4)


def test_params_carry_logical_axis_names():
  axes = models.param_axes(tiny_model(mlm_head=True))
  assert tuple(axes["word_embeddings"]["embedding"]) == ("vocab", "embed")
  assert tuple(axes["layers_0"]["attention"]["query"]["kernel"]) == ("embed", "heads", "head_dim")
  assert tuple(axes["layers_0"]["attention"]["out"]["kernel"]) == ("heads", "head_dim", "embed")
  assert tuple(axes["layers_1"]["mlp_in"]["kernel"]) == ("embed", "mlp")
  assert tuple(axes["layers_1"]["mlp_out"]["kernel"]) == ("mlp", "embed")
  assert tuple(axes["mlm_bias"]) == ("vocab",)


def test_one_impl_field_reaches_every_layer(monkeypatch, tiny_params):
  ids, seg = tiny_batch()
  seen = []
  real = fl.api.run  # the layers' path into the contract (fl.attention's too)

  def spy(*args, impl, **kwargs):
    seen.append(impl)
    return real(*args, impl=impl, **kwargs)

  monkeypatch.setattr(fl.api, "run", spy)
  model = tiny_model(impl="xla_chunked")
  params = tiny_params
  jax.eval_shape(lambda: model.apply({"params": params}, ids, seg, method=model.encode))
  assert seen == ["xla_chunked"] * model.num_layers
  with pytest.raises(ValueError, match="impl must be one of"):
    tiny_model(impl="flash").apply({"params": params}, ids, seg, method=tiny_model().encode)


def test_bad_fields_are_named():
  with pytest.raises(ValueError, match="pooling must be one of"):
    tiny_model(pooling="max")
  with pytest.raises(ValueError, match="hidden_size .* multiple of num_heads"):
    tiny_model(hidden_size=15)
  with pytest.raises(ValueError, match="remat_policy must be one of"):
    tiny_model(remat_policy="all")
  with pytest.raises(ValueError, match=r"attention_dropout_rate must be in \[0, 1\)"):
    tiny_model(attention_dropout_rate=1.0)


@pytest.mark.parametrize("impl", ["reference", "xla_chunked"])
def test_attention_window_and_global_tokens_limit_what_a_token_reads(impl):
  # One layer: token i's output depends on token j only if j is in i's window (w // 2 = 2 on each
  # side), or i or j is its document's first token (global_tokens=1). Positions restart per document.
  model = models.Bert(vocab_size=50, hidden_size=16, num_layers=1, num_heads=2, mlp_dim=32, max_len=32,
                      attention_window=4, global_tokens=1, impl=impl, dropout_rate=0.0)
  params = models.init_params(model, jax.random.key(0))
  ids = jnp.asarray(np.random.default_rng(0).integers(1, 50, (1, 24)), jnp.int32)
  seg = jnp.asarray([[1] * 12 + [2] * 12], jnp.int32)
  encode = lambda x: np.asarray(model.apply({"params": params}, x, seg, method=model.encode))
  base = encode(ids)
  changed = lambda j: np.abs(encode(ids.at[0, j].set(ids[0, j] % 49 + 1)) - base).max(-1)[0] > 1e-6
  np.testing.assert_array_equal(np.flatnonzero(changed(6)), [0, 4, 5, 6, 7, 8])  # band + doc 1's global
  np.testing.assert_array_equal(np.flatnonzero(changed(18)), [12, 16, 17, 18, 19, 20])  # doc 2's global: 12
  np.testing.assert_array_equal(np.flatnonzero(changed(12)), np.arange(12, 24))  # global: its whole doc
  with pytest.raises(ValueError, match="global_tokens must be"):
    models.Bert(vocab_size=50, global_tokens=1)

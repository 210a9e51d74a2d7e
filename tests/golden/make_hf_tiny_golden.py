"""Make tests/golden/hf_tiny/: tiny random BERT, RoBERTa, XLM-RoBERTa and ModernBERT checkpoints, with
Hugging Face transformers' outputs on them.

Run ONCE, in a separate virtualenv that has torch and transformers (the project itself never needs
torch); what it writes is committed and is what tests/test_hf_parity.py compares our models with:

    python -m venv /tmp/hfvenv
    /tmp/hfvenv/bin/pip install torch==2.13.0 transformers safetensors numpy
    /tmp/hfvenv/bin/python tests/golden/make_hf_tiny_golden.py

Each checkpoint directory holds config.json and model.safetensors as transformers saves them,
and golden.npz:
  input_ids, attention_mask [docs, len]: the documents right-padded into one batch;
  last_hidden_state [docs, len, hidden], mlm_logits [docs, len, vocab]: transformers on that batch;
  doc_hidden [tokens, hidden], doc_mlm_logits [tokens, vocab]: transformers on each document
    alone (no padding), concatenated in document order;
  BERT, RoBERTa: pooler_output / doc_pooler [docs, hidden] (the tanh pooler over the first token);
  ModernBERT: cls_logits / mean_logits (and doc_ versions) [docs, labels] of
    ModernBertForSequenceClassification with classifier_pooling "cls" / "mean", whose classifier
    is classifier_weight [labels, hidden] and classifier_bias [labels] (the checkpoint itself
    has no classifier: from_pretrained builds a new one).
The weights are random: initializer_range is large (0.2) and every 1-D parameter (norms,
biases) is perturbed, so attention is far from uniform and a wrong window, rotary base or
position offset changes the outputs by much more than the tests' 1e-4 tolerance.
"""

import argparse
import json
import pathlib

import numpy as np
import safetensors.torch
import torch
import transformers

OUT = pathlib.Path(__file__).with_name("hf_tiny")
LENGTHS = (24, 7, 15, 31)  # documents; the padded batch is 32 long
LABELS = 3

MODERNBERT = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=4, local_attention=8, global_attn_every_n_layers=2,
                  max_position_embeddings=64, initializer_range=0.2, pad_token_id=0, bos_token_id=2,
                  eos_token_id=3, cls_token_id=2, sep_token_id=3)
# The same with every optional bias on, its own rotary bases, tanh-GELU in the MLP.
MODERNBERT_BIAS = dict(MODERNBERT, norm_bias=True, attention_bias=True, mlp_bias=True, classifier_bias=True,
                       hidden_activation="gelu_pytorch_tanh", global_rope_theta=500.0, local_rope_theta=50.0,
                       local_attention=6)
BERT = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=40, type_vocab_size=2, initializer_range=0.2, pad_token_id=0)
ROBERTA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=40, type_vocab_size=1, layer_norm_eps=1e-5,
               initializer_range=0.2, pad_token_id=1, bos_token_id=0, eos_token_id=2)


def documents(vocab: int, seed: int) -> list[np.ndarray]:
  rng = np.random.default_rng(seed)
  return [rng.integers(4, vocab, size=n) for n in LENGTHS]  # ids 0-3 are special (pad among them)


def padded(docs, pad_id):
  ids = np.full((len(docs), 32), pad_id, np.int64)
  mask = np.zeros_like(ids)
  for i, d in enumerate(docs):
    ids[i, :len(d)], mask[i, :len(d)] = d, 1
  return torch.tensor(ids), torch.tensor(mask)


def perturb(model, seed):
  """Non-trivial norms and biases (transformers initializes them to 1 and 0)."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for p in model.parameters():
      if p.ndim == 1:
        p.add_(0.3 * torch.randn(p.shape, generator=gen))


def save(directory: pathlib.Path, config, tensors: dict, golden: dict):
  directory.mkdir(parents=True, exist_ok=True)
  config.save_pretrained(directory)
  safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()},
                              str(directory / "model.safetensors"), metadata={"format": "pt"})
  golden["versions"] = np.array([f"torch {torch.__version__}", f"transformers {transformers.__version__}"])
  np.savez_compressed(directory / "golden.npz", **golden)
  print(f"wrote {directory}: {sorted(json.loads((directory / 'config.json').read_text()))}")


def f32(x):
  return x.detach().numpy().astype(np.float32)


def make_roberta(name: str, model_type: str, seed: int, **overrides):
  """A RoBERTa (or XLM-R, or with model_type "bert" a BERT) checkpoint with its masked-LM head."""
  kinds = {"roberta": (transformers.RobertaConfig, transformers.RobertaModel,
                       transformers.RobertaForMaskedLM),
           "xlm-roberta": (transformers.XLMRobertaConfig, transformers.XLMRobertaModel,
                           transformers.XLMRobertaForMaskedLM),
           "bert": (transformers.BertConfig, transformers.BertModel, transformers.BertForMaskedLM)}
  config_cls, model_cls, mlm_cls = kinds[model_type]
  torch.manual_seed(seed)
  fields = BERT if model_type == "bert" else ROBERTA
  config = config_cls(**{**fields, **overrides}, attn_implementation="eager")
  mlm = mlm_cls(config).eval()
  perturb(mlm, seed)
  base = model_cls(config, add_pooling_layer=True).eval()
  perturb(base.pooler, seed + 1)
  encoder = mlm.bert if model_type == "bert" else mlm.roberta
  base.load_state_dict(encoder.state_dict(), strict=False)  # the MLM's encoder, plus a pooler
  prefix, head = ("bert.", "cls.predictions.") if model_type == "bert" else ("roberta.", "lm_head.")
  tensors = {prefix + k: v for k, v in base.state_dict().items()}
  tensors.update({k: v for k, v in mlm.state_dict().items() if k.startswith(head)
                  and not k.startswith(head + "decoder.")})  # the decoder is tied to the embeddings
  docs = documents(config.vocab_size, seed)
  ids, mask = padded(docs, config.pad_token_id)
  golden = {"input_ids": ids.numpy().astype(np.int32), "attention_mask": mask.numpy().astype(np.int32)}
  with torch.no_grad():
    out = base(input_ids=ids, attention_mask=mask)
    golden.update(last_hidden_state=f32(out.last_hidden_state), pooler_output=f32(out.pooler_output),
                  mlm_logits=f32(mlm(input_ids=ids, attention_mask=mask).logits))
    alone = [base(input_ids=torch.tensor(d)[None]) for d in docs]
    golden.update(doc_hidden=np.concatenate([f32(a.last_hidden_state[0]) for a in alone]),
                  doc_pooler=np.stack([f32(a.pooler_output[0]) for a in alone]),
                  doc_mlm_logits=np.concatenate([f32(mlm(input_ids=torch.tensor(d)[None]).logits[0])
                                                 for d in docs]))
  save(OUT / name, config, tensors, golden)


def make_modernbert(name: str, seed: int, fields: dict):
  torch.manual_seed(seed)
  config = transformers.ModernBertConfig(**fields, attn_implementation="eager")
  mlm = transformers.ModernBertForMaskedLM(config).eval()
  perturb(mlm, seed)
  tensors = {k: v for k, v in mlm.state_dict().items() if k != "decoder.weight"}  # tied to the embeddings
  classifier_config = transformers.ModernBertConfig(**fields, num_labels=LABELS, attn_implementation="eager")
  clf = transformers.ModernBertForSequenceClassification(classifier_config).eval()
  perturb(clf.classifier, seed + 1)
  missing, _ = clf.load_state_dict(mlm.state_dict(), strict=False)
  assert sorted(missing) == ["classifier.bias", "classifier.weight"], missing
  docs = documents(config.vocab_size, seed)
  ids, mask = padded(docs, config.pad_token_id)
  golden = {"input_ids": ids.numpy().astype(np.int32), "attention_mask": mask.numpy().astype(np.int32),
            "classifier_weight": f32(clf.classifier.weight), "classifier_bias": f32(clf.classifier.bias)}

  def logits(pooling, **inputs):
    clf.config.classifier_pooling = pooling
    return f32(clf(**inputs).logits)

  with torch.no_grad():
    golden.update(last_hidden_state=f32(mlm.model(input_ids=ids, attention_mask=mask).last_hidden_state),
                  mlm_logits=f32(mlm(input_ids=ids, attention_mask=mask).logits),
                  cls_logits=logits("cls", input_ids=ids, attention_mask=mask),
                  mean_logits=logits("mean", input_ids=ids, attention_mask=mask))
    alone = [torch.tensor(d)[None] for d in docs]
    golden.update(
        doc_hidden=np.concatenate([f32(mlm.model(input_ids=a).last_hidden_state[0]) for a in alone]),
        doc_mlm_logits=np.concatenate([f32(mlm(input_ids=a).logits[0]) for a in alone]),
        doc_cls_logits=np.concatenate([logits("cls", input_ids=a) for a in alone]),
        doc_mean_logits=np.concatenate([logits("mean", input_ids=a) for a in alone]))
  save(OUT / name, config, tensors, golden)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.parse_args()
  torch.use_deterministic_algorithms(True)
  make_roberta("roberta", "roberta", seed=1)
  make_roberta("bert", "bert", seed=5)
  make_roberta("xlm_roberta", "xlm-roberta", seed=2, pad_token_id=0)  # offset 1, not RoBERTa's 2
  make_modernbert("modernbert", seed=3, fields=MODERNBERT)
  make_modernbert("modernbert_bias", seed=4, fields=MODERNBERT_BIAS)


if __name__ == "__main__":
  main()

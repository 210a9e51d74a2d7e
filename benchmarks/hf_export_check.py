"""Does transformers load our export and compute our logits? Two steps, two environments.

The project never imports torch, so the check runs outside it, in a virtualenv with torch and
transformers (nothing in flash_layers or tests imports this file):

    python3 -m venv /tmp/hfvenv
    /tmp/hfvenv/bin/pip install torch transformers==5.23.0 safetensors tokenizers numpy
    # 1. in the project's environment: train, export, and our logits on the test articles
    python train.py --config configs/quickstart.py --workdir runs/quickstart
    python -m flash_layers.export --workdir runs/quickstart --out /tmp/quickstart_hf
    python -m benchmarks.hf_export_check ours --workdir runs/quickstart --out /tmp/ours.npz
    # 2. in the virtualenv: transformers on the same articles, compared
    /tmp/hfvenv/bin/python benchmarks/hf_export_check.py theirs --export /tmp/quickstart_hf \\
        --ours /tmp/ours.npz --out benchmarks/results/hf-export-check-<date>.json

Step 1 restores the run's best checkpoint (as the export does), tokenizes the eval split's
articles with the run's tokenizer at the run's max_len, one article per row, and saves the texts,
token ids, labels and our logits. Step 2 loads the export with `AutoTokenizer` and
`AutoModelForSequenceClassification`, tokenizes the same texts (truncation at the same length),
and records whether the token ids are identical, the largest |logit difference|, whether the
predictions agree, transformers' accuracy, and the versions.

The task heads (multi-label with its thresholds, regression with its standardization folded in, token
classification, masked LM), on a small random BERT and a small random ModernBERT, the same two ways:

    python -m benchmarks.hf_export_check heads-ours --out /tmp/heads
    /tmp/hfvenv/bin/python benchmarks/hf_export_check.py heads-theirs --dir /tmp/heads \\
        --out benchmarks/results/hf-export-heads-<date>.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import sys

import numpy as np

if __name__ == "__main__" and pathlib.Path(sys.path[0]).resolve() == pathlib.Path(__file__).resolve().parent:
  sys.path.pop(0)  # run as a file: benchmarks/profile.py would shadow the standard library's (torch uses it)


def ours(workdir: str, out: pathlib.Path, checkpoint: str = "best", batch_size: int = 16) -> None:
  """Our logits on the run's eval split (project environment)."""
  import jax
  import jax.numpy as jnp

  from flash_layers import export
  from flash_layers.training import task as task_lib

  run = export.restore_run(workdir, checkpoint=checkpoint)
  config, model, params = run["config"], run["model"], run["params"]
  records = task_lib.load_split(config, config.data.eval_split)
  texts = [records[i]["text"] for i in range(len(records))]
  labels = np.asarray([records[i]["label"] for i in range(len(records))])
  tokenizer = task_lib.make_tokenizer(config)
  windows = [w[0] for w in tokenizer.encode(texts)]  # "truncate": one window per article
  ids, seg = tokenizer.pad(windows, config.model.max_len)
  apply = jax.jit(lambda p, i, s: model.apply({"params": p}, i, s, max_docs=1)[:, 0])
  logits = np.concatenate([np.asarray(apply(params, jnp.asarray(ids[i:i + batch_size]),
                                            jnp.asarray(seg[i:i + batch_size])))
                           for i in range(0, len(texts), batch_size)])
  np.savez(out, texts=np.asarray(texts), labels=labels, input_ids=ids, lengths=seg.sum(1), logits=logits,
           label_names=np.asarray([str(n) for n in run["label_names"]]), max_len=config.model.max_len,
           step=run["step"], split=config.data.eval_split)
  print(f"{len(texts)} articles, step {run['step']}: our logits in {out}")


def theirs(export_dir: str, ours_file: pathlib.Path, out: pathlib.Path | None) -> dict:
  """transformers on the same articles (virtualenv with torch + transformers), compared with ours."""
  import torch
  import transformers

  saved = np.load(ours_file)
  texts, max_len = [str(t) for t in saved["texts"]], int(saved["max_len"])
  tokenizer = transformers.AutoTokenizer.from_pretrained(export_dir)
  model, loading = transformers.AutoModelForSequenceClassification.from_pretrained(
      export_dir, output_loading_info=True)
  model.eval()
  encoded = tokenizer(texts, truncation=True, max_length=max_len, padding="max_length", return_tensors="pt")
  ids = encoded["input_ids"].numpy()
  ids_identical = bool(np.array_equal(ids, saved["input_ids"]))
  with torch.no_grad():
    logits = np.concatenate([model(**{k: v[i:i + 16] for k, v in encoded.items()}).logits.numpy()
                             for i in range(0, len(texts), 16)])
  delta = np.abs(logits.astype(np.float64) - saved["logits"])
  predicted = logits.argmax(-1)
  result = {
      "date": datetime.date.today().isoformat(), "export": export_dir, "split": str(saved["split"]),
      "checkpoint_step": int(saved["step"]), "documents": len(texts), "max_len": max_len,
      "model_class": type(model).__name__, "tokenizer_class": type(tokenizer).__name__,
      "labels": [model.config.id2label[i] for i in range(model.config.num_labels)],
      "labels_match": [model.config.id2label[i] for i in range(model.config.num_labels)]
      == [str(n) for n in saved["label_names"]],
      "missing_keys": sorted(loading["missing_keys"]), "unexpected_keys": sorted(loading["unexpected_keys"]),
      "input_ids_identical": ids_identical, "max_abs_logit_diff": float(delta.max()),
      "mean_abs_logit_diff": float(delta.mean()),
      "predictions_agree": int((predicted == saved["logits"].argmax(-1)).sum()),
      "accuracy_transformers": float((predicted == saved["labels"]).mean()),
      "accuracy_ours": float((saved["logits"].argmax(-1) == saved["labels"]).mean()),
      "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                   "python": platform.python_version()},
      "dtype": "float32", "device": "cpu",
  }
  print(json.dumps(result, indent=1))
  if out is not None:
    out.write_text(json.dumps(result, indent=1) + "\n")
  return result


HEADS = {  # export_model's problem_type -> (transformers' Auto class, what our model computes)
    "multi_label_classification": ("AutoModelForSequenceClassification", "classify"),
    "regression": ("AutoModelForSequenceClassification", "classify"),
    "token_classification": ("AutoModelForTokenClassification", "tag"),
    "masked_lm": ("AutoModelForMaskedLM", "mlm"),
}


def heads_ours(out: pathlib.Path) -> None:
  """Step 1 of the task-head check (project environment): a small random BERT and ModernBERT with every
  head, exported once per task head, and our outputs on padded rows, one document each."""
  import jax
  import jax.numpy as jnp

  from flash_layers import models
  from flash_layers.models.export import export_model

  families = {
      "bert": models.Bert(vocab_size=200, hidden_size=32, num_layers=2, num_heads=4, mlp_dim=64, max_len=40,
                          num_labels=3, impl="reference", mlm_head=True, dropout_rate=0.0),
      "modernbert": models.ModernBert(vocab_size=200, hidden_size=32, num_layers=3, num_heads=4, mlp_dim=48,
                                      max_len=40, local_attention=8, global_attn_every_n_layers=2,
                                      num_labels=3, impl="reference", mlm_head=True)}
  rng = np.random.default_rng(0)
  lengths = [40, 23, 9]
  ids = np.zeros((3, 40), np.int32)
  for r, n in enumerate(lengths):
    ids[r, :n] = rng.integers(5, 200, n)
  seg = (np.arange(40)[None] < np.asarray(lengths)[:, None]).astype(np.int32)
  mean, std = [2.0, -1.0, 0.5], [3.0, 0.5, 1.5]
  for family, model in families.items():
    params = jax.tree.map(np.asarray, models.init_params(model, jax.random.key(0)))
    params = jax.tree.map(lambda x: x + rng.normal(0, 0.05, np.shape(x)).astype(np.float32), params)
    saved = {"input_ids": ids, "attention_mask": seg}
    for problem, (_, method) in HEADS.items():
      extra = {"thresholds": [0.3, 0.5, 0.8]} if problem == "multi_label_classification" else {}
      if problem == "regression":
        extra["standardization"] = (mean, std)
      names = [] if problem == "masked_lm" else ["a", "b", "c"]
      export_model(model, params, out / family / problem, label_names=names, tokenizer=None,
                   problem_type=problem, **extra)
      logits = np.asarray(model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(seg), method=method))
      if method == "classify":
        logits = logits[:, 0]
      if problem == "regression":
        logits = logits * np.asarray(std) + np.asarray(mean)  # the folded head's outputs
      saved[problem] = logits
    np.savez(out / family / "ours.npz", **saved)
  print(f"exported {sorted(HEADS)} of {sorted(families)}, and our outputs, to {out}")


def heads_theirs(directory: pathlib.Path, out: pathlib.Path | None) -> dict:
  """Step 2 (virtualenv with torch + transformers): each export loaded by its Auto class, compared."""
  import torch
  import transformers

  result = {"date": datetime.date.today().isoformat(), "heads": {},
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}
  for family, problem in ((f, p) for f in ("bert", "modernbert") for p in HEADS):
    auto = HEADS[problem][0]
    saved = np.load(directory / family / "ours.npz")
    ids, mask = torch.tensor(saved["input_ids"]).long(), torch.tensor(saved["attention_mask"]).long()
    loader = getattr(transformers, auto)
    model, loading = loader.from_pretrained(directory / family / problem, output_loading_info=True,
                                            attn_implementation="eager")
    model.eval()
    with torch.no_grad():
      logits = model(input_ids=ids, attention_mask=mask).logits.numpy().astype(np.float64)
    real = saved["attention_mask"] > 0 if logits.ndim == 3 else np.ones(len(logits), bool)
    delta = np.abs(logits - saved[problem])[real]
    result["heads"][f"{family}/{problem}"] = {
        "model_class": type(model).__name__, "problem_type": model.config.problem_type,
        "thresholds": getattr(model.config, "thresholds", None),
        "missing_keys": sorted(loading["missing_keys"]),
        "unexpected_keys": sorted(loading["unexpected_keys"]), "max_abs_diff": float(delta.max())}
  print(json.dumps(result, indent=1))
  if out is not None:
    out.write_text(json.dumps(result, indent=1) + "\n")
  return result


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  steps = parser.add_subparsers(dest="step", required=True)
  first = steps.add_parser("ours", help="step 1, in the project's environment: our logits")
  first.add_argument("--workdir", required=True)
  first.add_argument("--checkpoint", default="best")
  first.add_argument("--out", type=pathlib.Path, required=True, help="an .npz file")
  second = steps.add_parser("theirs", help="step 2, in a virtualenv with torch + transformers: compare")
  second.add_argument("--export", required=True, help="the directory flash_layers.export wrote")
  second.add_argument("--ours", type=pathlib.Path, required=True, help="step 1's .npz")
  second.add_argument("--out", type=pathlib.Path, default=None, help="write the result as JSON here")
  third = steps.add_parser("heads-ours", help="the task heads, step 1 (project environment): export and ours")
  third.add_argument("--out", type=pathlib.Path, required=True, help="a directory to write")
  fourth = steps.add_parser("heads-theirs", help="the task heads, step 2 (torch + transformers): compare")
  fourth.add_argument("--dir", type=pathlib.Path, required=True, help="step 1's directory")
  fourth.add_argument("--out", type=pathlib.Path, default=None, help="write the result as JSON here")
  args = parser.parse_args(argv)
  if args.step == "ours":
    ours(args.workdir, args.out, args.checkpoint)
  elif args.step == "theirs":
    theirs(args.export, args.ours, args.out)
  elif args.step == "heads-ours":
    heads_ours(args.out)
  else:
    heads_theirs(args.dir, args.out)


if __name__ == "__main__":
  main()

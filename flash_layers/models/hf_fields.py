"""Reading a Hugging Face config.json field by field: each one honoured, or refused by name.

Every family's reader takes the fields it implements through `ConfigFields`; `finish()` then
refuses whatever is left (a field we do not know could change the maths, so it is never
silently dropped). `METADATA` lists what changes no encoder output: bookkeeping, tokenizer ids,
label names, generation settings that older transformers versions wrote into every config.
"""

from __future__ import annotations

import pathlib
from typing import Any

from flash_layers.errors import UserError


class CheckpointError(UserError, ValueError):
  """A checkpoint that does not fit the model: names the field or tensor, and the file."""


METADATA = frozenset({
    # bookkeeping
    "_name_or_path", "name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype",
    "dtype", "_attn_implementation_autoset", "_commit_hash", "use_cache", "output_past",
    "gradient_checkpointing", "output_attentions", "output_hidden_states", "return_dict", "torchscript",
    "use_bfloat16", "xla_device", "chunk_size_feed_forward", "tokenizer_class", "prefix",
    "task_specific_params",
    # labels (from_pretrained builds a new classifier with num_labels=)
    "id2label", "label2id", "num_labels", "problem_type", "finetuning_task",
    # a multi-label decision rule on the outputs (our export's), not part of the network
    "thresholds",
    # special-token ids (the tokenizer's business; RoBERTa reads pad_token_id itself)
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "cls_token_id", "unk_token_id",
    "mask_token_id", "decoder_start_token_id",
    # generation settings older transformers saved in every config; an encoder never generates
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens", "tf_legacy_loss", "is_encoder_decoder",
    "tie_encoder_decoder", "cross_attention_hidden_size", "sep_token",
})

_MISSING = object()


class ConfigFields:
  """The fields of one config.json, each taken (honoured), checked or refused by name."""

  def __init__(self, config: dict[str, Any], file: pathlib.Path):
    self.config, self.file, self.taken = config, file, set()

  def fail(self, message: str):
    raise CheckpointError(f"{self.file}: {message}")

  def has(self, name: str) -> bool:
    return name in self.config

  def get(self, name: str, default: Any = _MISSING) -> Any:
    """The value (or default); a required field that is absent is an error naming it."""
    self.taken.add(name)
    if name in self.config:
      return self.config[name]
    if default is _MISSING:
      self.fail(f"config field {name!r} is missing")
    return default

  def integer(self, name: str, default: Any = _MISSING) -> int:
    value = self.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
      self.fail(f"config field {name!r} must be a positive int; got {value!r}")
    return value

  def number(self, name: str, default: Any = _MISSING) -> float:
    value = self.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      self.fail(f"config field {name!r} must be a number; got {value!r}")
    return float(value)

  def flag(self, name: str, default: bool) -> bool:
    value = self.get(name, default)
    if not isinstance(value, bool):
      self.fail(f"config field {name!r} must be true or false; got {value!r}")
    return value

  def choice(self, name: str, allowed: tuple, default: Any = _MISSING, why: str = "") -> Any:
    """A field honoured only for the values in `allowed`; others are refused with `why`."""
    value = self.get(name, default)
    if value not in allowed:
      self.fail(f"config field {name}={value!r} is not supported (supported: "
                f"{', '.join(map(repr, allowed))}){'; ' + why if why else ''}")
    return value

  def ignore(self, *names: str) -> None:
    """Fields the reference implementation itself does not read (documented per family)."""
    self.taken.update(names)

  def finish(self) -> None:
    unknown = sorted(set(self.config) - self.taken - METADATA)
    if unknown:
      self.fail(f"config field(s) {unknown} are not supported by flash_layers.models (a field we do not "
                "implement could change the outputs, so it is refused rather than ignored)")

"""``fl.masks``: the named mask_mods (`flash_layers.contract.masks`), under their public name.

    out = fl.attention(q, k, v, mask_mod=fl.masks.prefix_lm(operand=0), mod_operands=(prefix,))

The built-in rules are `flash_layers.contract.mask_rules`; their block form `contract.block_info`.
"""

from flash_layers.contract.masks import (  # noqa: F401
  all_of,
  any_of,
  block_table,
  causal,
  chunked_causal,
  dilated,
  document,
  global_tokens,
  prefix_lm,
  sliding_window,
)

__all__ = ["all_of", "any_of", "block_table", "causal", "chunked_causal", "dilated", "document",
           "global_tokens", "prefix_lm", "sliding_window"]

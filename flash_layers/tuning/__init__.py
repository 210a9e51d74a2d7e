"""Autotuning: measured configurations per device and shape bucket, kept in a JSON cache.

`flash_layers.autotune` (tuner.py) times candidate configurations (candidates.py) and stores the
winner (cache.py); `fl.attention(..., block_sizes="autotune")` and impl="auto" read it back. This
package's __init__ imports nothing, so that validate and auto can read the cache (a low layer) without
importing the tuner and its candidates (which import auto and dispatch: a higher
layer). docs/tuning.md has the user's view.
"""

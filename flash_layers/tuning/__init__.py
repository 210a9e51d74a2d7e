"""Autotuning: measured configurations per device and shape bucket, kept in a JSON cache.

`flash_layers.autotune` (tuner.py) times candidate configurations (candidates.py) and stores the
winner (cache.py); `fl.attention(..., block_sizes="autotune")` and impl="auto" read it back. This
package's __init__ imports nothing, so that dispatch can read the cache without importing the tuner
(which imports dispatch). docs/tuning.md has the user's view.
"""
